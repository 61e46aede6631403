import pytest
import torch

import prune_heads as ph


def make_scores(rows, group_sizes=None, heads=None, original=None):
    names = [f"layers.{i}.attn" for i in range(len(rows))]
    return ph.HeadScores(
        method="test", num_examples=1,
        scores={n: torch.tensor(r, dtype=torch.float32) for n, r in zip(names, rows)},
        heads={n: tuple(heads[i] if heads and heads[i] else range(len(r))) for i, (n, r) in enumerate(zip(names, rows))},
        group_sizes={n: (group_sizes or [1] * len(rows))[i] for i, n in enumerate(names)},
        original_heads={n: (original[i] if original else len(r)) for i, (n, r) in enumerate(zip(names, rows))},
    )


def test_global_sparsity_removes_the_lowest_heads():
    scores = make_scores([[0.9, 0.1, 0.5, 0.2], [0.05, 0.8, 0.7, 0.6]])
    assert ph.select_heads(scores, sparsity=0.375) == {"layers.0.attn": [1, 3], "layers.1.attn": [0]}
    assert ph.select_heads(scores, num_heads=2) == {"layers.0.attn": [1], "layers.1.attn": [0]}


def test_layer_scope_and_keep_per_layer():
    scores = make_scores([[0.9, 0.1, 0.5, 0.2], [0.05, 0.8, 0.7, 0.6]])
    assert ph.select_heads(scores, sparsity=0.5, scope="layer") == {"layers.0.attn": [1, 3], "layers.1.attn": [0, 3]}
    assert ph.select_heads(scores, keep_per_layer=3) == {"layers.0.attn": [1], "layers.1.attn": [0]}


def test_min_heads_and_ignore_protect_layers():
    scores = make_scores([[0.1, 0.2, 0.3, 0.4], [0.9, 0.8, 0.7, 0.6]])
    assert ph.select_heads(scores, num_heads=4, min_heads_per_layer=2) == {"layers.0.attn": [0, 1],
                                                                          "layers.1.attn": [2, 3]}
    assert ph.select_heads(scores, num_heads=4, min_heads_per_layer=0) == {"layers.0.attn": [0, 1, 2, 3]}
    assert ph.select_heads(scores, num_heads=2, ignore=r"layers\.0\.") == {"layers.1.attn": [2, 3]}


@pytest.mark.parametrize("kwargs, message", [
    ({"sparsity": 1.0}, r"at most 6 can go \(sparsity 0.750\)"),
    ({"num_heads": 9, "min_heads_per_layer": 0}, "cannot remove 9 heads"),
    ({"sparsity": 0.5, "num_heads": 2}, "exactly one of"),
    ({"sparsity": 1.5}, "between 0 and 1"),
    ({"keep_per_layer": 0}, "keep at least 1"),
])
def test_impossible_requests_say_what_is_possible(kwargs, message):
    with pytest.raises(ph.PlanError, match=message):
        ph.select_heads(make_scores([[0.1, 0.2, 0.3, 0.4], [0.9, 0.8, 0.7, 0.6]]), **kwargs)


def test_sparsity_counts_heads_already_removed():
    scores = make_scores([[0.3, 0.4], [0.9, 0.8, 0.7, 0.6]], heads=[(0, 3), None], original=[4, 4])
    assert ph.select_heads(scores, sparsity=0.5) == {"layers.0.attn": [0], "layers.1.attn": [3]}


def test_grouped_query_layers_lose_groups_or_even_heads():
    # 6 query heads, 2 per KV head: groups {0,1}, {2,3}, {4,5}
    scores = make_scores([[0.1, 0.2, 0.9, 0.8, 0.15, 0.3]], group_sizes=[2])
    assert ph.select_heads(scores, num_heads=2, gqa="groups") == {"layers.0.attn": [0, 1]}
    assert ph.select_heads(scores, num_heads=3, gqa="uniform") == {"layers.0.attn": [0, 3, 4]}
    assert ph.select_heads(scores, num_heads=4, gqa="groups") == {"layers.0.attn": [0, 1, 4, 5]}


def test_uniform_plans_keep_the_same_heads_in_every_layer():
    scores = make_scores([[0.9, 0.1, 0.5, 0.2], [0.05, 0.8, 0.7, 0.6], [0.3, 0.2, 0.1, 0.4]])
    # sparsity 0.5 of 12 heads: each layer loses its own two weakest, whatever the global ranking says
    assert ph.select_heads(scores, sparsity=0.5, uniform=True) == {
        "layers.0.attn": [1, 3], "layers.1.attn": [0, 3], "layers.2.attn": [1, 2]}
    assert ph.select_heads(scores, num_heads=4, uniform=True) == ph.select_heads(scores, keep_per_layer=3)
    with pytest.raises(ph.PlanError, match="drop ignore"):
        ph.select_heads(scores, sparsity=0.5, uniform=True, ignore="layers.0")
    uneven = make_scores([[0.3, 0.4], [0.9, 0.8, 0.7, 0.6]], heads=[(0, 3), None], original=[4, 4])
    with pytest.raises(ph.PlanError, match="same heads now"):
        ph.select_heads(uneven, sparsity=0.75, uniform=True)


def test_uniform_grouped_plans_round_to_whole_units():
    # two layers of 6 query heads, 2 per KV head
    scores = make_scores([[0.1, 0.2, 0.9, 0.8, 0.15, 0.3], [0.9, 0.8, 0.1, 0.1, 0.5, 0.5]], group_sizes=[2, 2])
    by_groups = ph.select_heads(scores, sparsity=0.3, uniform=True, gqa="groups")  # 3.6 heads -> one group each
    assert by_groups == {"layers.0.attn": [0, 1], "layers.1.attn": [2, 3]}
    by_rounds = ph.select_heads(scores, sparsity=0.5, uniform=True, gqa="uniform")  # one head from every group
    assert by_rounds == {"layers.0.attn": [0, 3, 4], "layers.1.attn": [1, 2, 4]}
