import pytest
import tiny_models as tm
import torch

import prune_heads as ph


def test_global_sparsity_removes_the_lowest_heads():
    scores = tm.make_scores([[0.9, 0.1, 0.5, 0.2], [0.05, 0.8, 0.7, 0.6]])
    assert ph.select_heads(scores, sparsity=0.375) == {"layers.0.attn": [1, 3], "layers.1.attn": [0]}
    assert ph.select_heads(scores, num_heads=2) == {"layers.0.attn": [1], "layers.1.attn": [0]}


def test_layer_scope_and_keep_per_layer():
    scores = tm.make_scores([[0.9, 0.1, 0.5, 0.2], [0.05, 0.8, 0.7, 0.6]])
    assert ph.select_heads(scores, sparsity=0.5, scope="layer") == {"layers.0.attn": [1, 3], "layers.1.attn": [0, 3]}
    assert ph.select_heads(scores, keep_per_layer=3) == {"layers.0.attn": [1], "layers.1.attn": [0]}


def test_min_heads_and_ignore_protect_layers():
    scores = tm.make_scores([[0.1, 0.2, 0.3, 0.4], [0.9, 0.8, 0.7, 0.6]])
    assert ph.select_heads(scores, num_heads=4, min_heads_per_layer=2) == {
        "layers.0.attn": [0, 1],
        "layers.1.attn": [2, 3],
    }
    assert ph.select_heads(scores, num_heads=4, min_heads_per_layer=0) == {"layers.0.attn": [0, 1, 2, 3]}
    assert ph.select_heads(scores, num_heads=2, ignore=r"layers\.0\.") == {"layers.1.attn": [2, 3]}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sparsity": 1.0}, r"nearest that can go are 6 heads \(sparsity 0.7500\)"),
        ({"num_heads": 9, "min_heads_per_layer": 0}, r"cannot remove exactly 9 heads.* 8 heads \(sparsity 1.0000\)"),
        ({"sparsity": 0.5, "num_heads": 2}, "exactly one of"),
        ({"sparsity": 1.5}, "between 0 and 1"),
        ({"num_heads": -3}, "0 or more"),
        ({"keep_per_layer": 0}, r"4 heads from layers.0.attn \(keep 0\).* at least 1 kept per layer"),
    ],
)
def test_impossible_requests_say_what_is_possible(kwargs, message):
    with pytest.raises(ph.PlanError, match=message):
        ph.select_heads(tm.make_scores([[0.1, 0.2, 0.3, 0.4], [0.9, 0.8, 0.7, 0.6]]), **kwargs)


def test_sparsity_counts_heads_already_removed():
    scores = tm.make_scores([[0.3, 0.4], [0.9, 0.8, 0.7, 0.6]], heads=[(0, 3), None], original=[4, 4])
    assert ph.select_heads(scores, sparsity=0.5) == {"layers.0.attn": [0], "layers.1.attn": [3]}


def test_grouped_query_layers_lose_groups_or_even_heads():
    # 6 query heads, 2 per KV head: groups {0,1}, {2,3}, {4,5}
    scores = tm.make_scores([[0.1, 0.2, 0.9, 0.8, 0.15, 0.3]], group_sizes=[2])
    assert ph.select_heads(scores, num_heads=2, gqa="groups") == {"layers.0.attn": [0, 1]}
    assert ph.select_heads(scores, num_heads=3, gqa="even") == {"layers.0.attn": [0, 3, 4]}
    with pytest.warns(DeprecationWarning, match="gqa='even'"):  # the old name still works
        assert ph.select_heads(scores, num_heads=3, gqa="uniform") == {"layers.0.attn": [0, 3, 4]}
    assert ph.select_heads(scores, num_heads=4, gqa="groups") == {"layers.0.attn": [0, 1, 4, 5]}


def test_uniform_plans_keep_the_same_heads_in_every_layer():
    scores = tm.make_scores([[0.9, 0.1, 0.5, 0.2], [0.05, 0.8, 0.7, 0.6], [0.3, 0.2, 0.1, 0.4]])
    # sparsity 0.5 of 12 heads: each layer loses its own two weakest, whatever the global ranking says
    assert ph.select_heads(scores, sparsity=0.5, uniform=True) == {
        "layers.0.attn": [1, 3],
        "layers.1.attn": [0, 3],
        "layers.2.attn": [1, 2],
    }
    assert ph.select_heads(scores, num_heads=3, uniform=True) == ph.select_heads(scores, keep_per_layer=3)
    with pytest.raises(ph.PlanError, match="every layer alike"):  # 4 heads over 3 layers: not silently 3
        ph.select_heads(scores, num_heads=4, uniform=True)
    with pytest.raises(ph.PlanError, match="drop ignore"):
        ph.select_heads(scores, sparsity=0.5, uniform=True, ignore="layers.0")
    uneven = tm.make_scores([[0.3, 0.4], [0.9, 0.8, 0.7, 0.6]], heads=[(0, 3), None], original=[4, 4])
    with pytest.raises(ph.PlanError, match="same heads now"):
        ph.select_heads(uneven, sparsity=0.75, uniform=True)


def test_uniform_grouped_plans_take_whole_units():
    # two layers of 6 query heads, 2 per KV head
    scores = tm.make_scores([[0.1, 0.2, 0.9, 0.8, 0.15, 0.3], [0.9, 0.8, 0.1, 0.1, 0.5, 0.5]], group_sizes=[2, 2])
    by_groups = ph.select_heads(scores, sparsity=0.3, uniform=True, gqa="groups")  # 3.6 -> 4 heads, a group each
    assert by_groups == {"layers.0.attn": [0, 1], "layers.1.attn": [2, 3]}
    by_rounds = ph.select_heads(scores, sparsity=0.5, uniform=True, gqa="even")  # one head from every group
    assert by_rounds == {"layers.0.attn": [0, 3, 4], "layers.1.attn": [1, 2, 4]}


GQA = [[0.1, 0.2, 0.9, 0.8, 0.15, 0.3], [0.9, 0.8, 0.1, 0.1, 0.5, 0.5]]  # 2 layers x 6 heads, 2 per KV head


def test_budgets_whole_groups_cannot_meet_are_refused_with_the_nearest_reachable_ones():
    scores = tm.make_scores(GQA, group_sizes=[2, 2])
    with pytest.raises(
        ph.PlanError,
        match=r"exactly 3 heads: heads go as whole KV groups.* 2 heads "
        r"\(sparsity 0.1667\) or 4 heads \(sparsity 0.3333\)",
    ):
        ph.select_heads(scores, num_heads=3)
    with pytest.raises(ph.PlanError, match=r"sparsity 0.1 \(1 more heads\).* 0 heads .* or 2 heads"):
        ph.select_heads(scores, sparsity=0.1)  # never silently an unpruned model
    assert ph.select_heads(scores, num_heads=3, round="down") == {"layers.1.attn": [2, 3]}
    assert sum(map(len, ph.select_heads(scores, num_heads=3, round="up").values())) == 4
    assert sum(map(len, ph.select_heads(scores, num_heads=5, round="nearest").values())) == 4  # ties go down
    with pytest.raises(ph.PlanError, match="round must be one of"):
        ph.select_heads(scores, num_heads=4, round="sideways")


def test_every_plan_removes_exactly_what_was_asked():
    scores = tm.make_scores(GQA, group_sizes=[2, 2])
    for num in range(0, 9, 2):
        plan = ph.select_heads(scores, num_heads=num)
        assert sum(len(h) for h in plan.values()) == num
    for num in (0, 3, 6):
        assert sum(map(len, ph.select_heads(scores, num_heads=num, gqa="even").values())) == num


def test_layer_granularity_removes_whole_attention_blocks():
    scores = tm.make_scores([[0.9, 0.8, 0.7, 0.6], [0.1, 0.2, 0.1, 0.3], [0.5, 0.5, 0.5, 0.5]])
    assert ph.select_heads(scores, num_heads=4, granularity="layer") == {"layers.1.attn": [0, 1, 2, 3]}
    assert ph.select_heads(scores, sparsity=2 / 3, granularity="layer") == {
        "layers.1.attn": [0, 1, 2, 3],
        "layers.2.attn": [0, 1, 2, 3],
    }
    with pytest.raises(ph.PlanError, match="whole attention layers.* 4 heads .* or 8 heads"):
        ph.select_heads(scores, num_heads=6, granularity="layer")


def test_interactions_is_a_strategy_of_select_heads():
    block = torch.diag(torch.tensor([0.1, 0.2, 0.3, 0.4])).tolist()
    scores = tm.make_scores([[0.1, 0.2, 0.3, 0.4]])
    scores.meta["fisher_blocks"] = {"layers.0.attn": block}
    assert ph.select_heads(scores, num_heads=2, strategy="interactions") == ph.plan_with_interactions(scores, 2)
    with pytest.raises(ph.PlanError, match="needs scope='global', gqa='groups'"):
        ph.select_heads(scores, num_heads=2, strategy="interactions", gqa="even")


def test_check_budget_reads_the_structure_alone():

    llama = tm.build("llama")  # 3 layers x 4 heads, 2 per KV head
    assert ph.check_budget(llama, sparsity=0.5) == 6
    with pytest.raises(ph.PlanError, match=r"exactly 1 heads.* 0 heads \(sparsity 0.0000\) or 2 heads"):
        ph.check_budget(llama, num_heads=1)
    assert ph.check_budget(llama, num_heads=1, round="up") == 2
    with pytest.raises(ph.UnsupportedModelError, match=r"no attention layers found in the model \(Linear\)"):
        ph.check_budget(torch.nn.Linear(2, 2), sparsity=0.5)
