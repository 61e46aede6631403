import math

import pytest
import tiny_models as tm

import prune_heads as ph
from prune_heads.recovery.prefixes import deepest_within, prefix_length, prefix_plan, ranked_order


@pytest.mark.parametrize("threshold", [0, 1, 7, 29, 30])
def test_the_longest_prefix_within_the_bound_in_a_logarithmic_number_of_measurements(threshold):
    asked = []

    def rise(count: int) -> float:
        asked.append(count)
        return 0.01 * count if count <= threshold else 0.5 + count

    count, measured = deepest_within(30, rise, bound=0.3)
    assert count == threshold and measured.get(count, 0.0) <= 0.3
    assert threshold == 30 or measured[count + 1] > 0.3  # the next one measured, above the bound
    assert len(asked) <= math.ceil(math.log2(30)) + 1 and len(set(asked)) == len(asked)


def test_rises_that_are_not_monotone_still_end_at_a_prefix_within_the_bound_next_to_one_above():
    rises = [0.0, -0.01, 0.02, 0.5, 0.01, 0.6, 0.7, 0.02, 0.9]
    count, measured = deepest_within(8, rises.__getitem__, bound=0.05)
    assert measured[count] <= 0.05 and measured[count + 1] > 0.05
    assert deepest_within(0, rises.__getitem__, 0.05) == (0, {})


def test_each_prefix_plan_holds_the_shorter_ones():
    order = [("a", (2, 3)), ("b", (0, 1)), ("a", (0, 1)), ("c", (4,))]
    plans = [prefix_plan(order, k) for k in range(len(order) + 1)]
    assert plans[0] == {} and plans[3] == {"a": [0, 1, 2, 3], "b": [0, 1]}
    for shorter, longer in zip(plans, plans[1:]):
        assert all(set(heads) <= set(longer[name]) for name, heads in shorter.items())


def test_the_prefix_that_removes_a_number_of_heads():
    order = [("a", (0, 1)), ("b", (0, 1)), ("a", (2, 3))]
    assert [prefix_length(order, heads) for heads in (0, 2, 4, 6)] == [0, 1, 2, 3]
    assert prefix_length(order, 3) is None and prefix_length(order, 8) is None


def test_the_ranking_as_one_order_takes_at_each_length_what_the_ranking_selects():
    """Each prefix of the plain ranking's order is the plan `select_heads` makes at that count, under a layer's
    minimum of kept heads, and with KV groups as units."""
    heads = tm.make_scores([[0.5, 0.1, 0.9, 0.3], [0.2, 0.8, 0.05, 0.6], [0.4, 0.7, 0.15, 0.35]])
    groups = tm.make_scores([[0.5, 0.1, 0.9, 0.3], [0.2, 0.8, 0.05, 0.6]], group_sizes=[2, 2])
    for scores, deepest, minimum in ((heads, 9, 1), (heads, 4, 0), (groups, 6, 0)):
        order = ranked_order(scores, ph.HeadBudget(num_heads=deepest, min_heads_per_layer=minimum), deepest)
        assert sum(len(unit) for _, unit in order) == deepest
        for count in range(1, len(order) + 1):
            removed = sum(len(unit) for _, unit in order[:count])
            expected = ph.select_heads(scores, ph.HeadBudget(num_heads=removed, min_heads_per_layer=minimum))
            assert prefix_plan(order, count) == {n: sorted(h) for n, h in expected.items() if h}
    assert {len(unit) for _, unit in ranked_order(groups, ph.HeadBudget(num_heads=6, min_heads_per_layer=0), 6)} == {2}
