"""`resolve_budget`: every way of asking for a budget comes to one checked `Budget`, before any data is read."""

import pytest
import tiny_models as tm

import prune_heads as ph
from prune_heads.config import PruneConfig, RecoveryConfig, ScoringConfig, SelectionConfig


def config(**selection) -> PruneConfig:
    return PruneConfig(selection=SelectionConfig(**selection))


@pytest.fixture(scope="module")
def llama():
    return tm.build("llama")  # 3 layers of 4 query heads over 2 KV heads: 6 groups of 2 heads


def test_a_count_and_a_share_resolve_to_the_heads_they_remove(llama):
    budget = ph.resolve_budget(llama, config(num_heads=4))
    assert (budget.asked, budget.removes, budget.given, budget.depths) == (4, 4, None, ())
    assert budget.order == budget.heads and budget.heads.num_heads == 4
    assert ph.resolve_budget(llama, config(sparsity=0.5)).removes == 6


def test_a_count_whole_groups_cannot_meet_is_refused_unless_rounded(llama):
    with pytest.raises(ph.PlanError, match="nearest"):
        ph.resolve_budget(llama, config(num_heads=3))
    rounded = ph.resolve_budget(llama, config(num_heads=3, round="up"))
    assert (rounded.asked, rounded.removes) == (3, 4)


def test_a_flops_and_a_kv_cache_budget_become_heads(llama):
    flops = ph.resolve_budget(llama, config(flops=0.9))
    assert flops.heads.num_heads == ph.heads_for_flops(llama, 0.9) and flops.removes % 2 == 0
    kv = ph.resolve_budget(llama, config(kv_cache="8KiB@64"))  # 12 KiB whole, 2 KiB a group: two groups go
    assert kv.removes == 4 == ph.heads_for_kv_cache(llama, ph.KvCacheBudget.parse("8KiB@64"))
    assert ph.kv_cache_size(llama, 64) == 12 * 1024


def test_depths_resolve_to_heads_and_the_order_goes_to_the_deepest(llama):
    budget = ph.resolve_budget(llama, config(num_heads=2, depths="1/6,1/2"))
    assert budget.depths == ((1 / 6, 2), (0.5, 6))
    assert budget.order.num_heads == 6 and budget.heads.num_heads == 2


def test_a_plan_given_whole_is_its_own_budget(llama):
    budget = ph.resolve_budget(llama, config(), plan={0: [0, 1], "model.layers.2.self_attn": [2, 3], 1: []})
    assert budget.given == {"model.layers.0.self_attn": [0, 1], "model.layers.2.self_attn": [2, 3]}
    assert (budget.asked, budget.removes) == (4, 4)
    with pytest.raises(ph.ConfigError, match="chooses the plan"):
        ph.resolve_budget(llama, config(depths="1/3"), plan={0: [0, 1]})


def test_a_plan_given_whole_carries_the_kv_heads_it_shares_in_layers_it_leaves_whole(llama):
    plan = {0: [0, 1], "shared_kv_heads": {"model.layers.1.self_attn": {"1": 0}}}  # as plan.json holds it
    budget = ph.resolve_budget(llama, config(), plan=plan)
    assert budget.given == {"model.layers.0.self_attn": [0, 1]} and budget.removes == 2
    assert budget.shared == {"model.layers.1.self_attn": {1: 0}}
    with pytest.raises(ph.PlanError, match="removes heads of model.layers.1.self_attn and shares its KV heads"):
        ph.resolve_budget(llama, config(), plan={1: [0, 1], "shared_kv_heads": {1: {1: 0}}})
    with pytest.raises(ph.PlanError, match="merge each into one that stays"):
        ph.resolve_budget(llama, config(), plan={"shared_kv_heads": {1: {1: 1}}})


@pytest.mark.parametrize(
    "made, message",
    [
        (dict(selection=SelectionConfig(max_loss=3), recovery=RecoveryConfig(holdout=0)), "holdout above 0"),
        (dict(selection=SelectionConfig(sparsity=0.0, depths="1/3", uniform=True)), "one at a time"),
        (
            dict(selection=SelectionConfig(flops=0.8, num_heads=10)),
            r"exactly one of .* \(has \['num_heads', 'flops'\]\)",
        ),
        (dict(selection=SelectionConfig(flops=0.8, kv_cache="8KiB@64")), "exactly one of"),
        (dict(selection=SelectionConfig()), r"exactly one of .* \(has none\)"),
        (dict(selection=SelectionConfig(sparsity=0.5), scoring=ScoringConfig(steps=2)), "turn recovery off"),
        (
            dict(selection=SelectionConfig(num_heads=2), scoring=ScoringConfig(steps=2), recovery=RecoveryConfig.off()),
            "needs selection.sparsity",
        ),
    ],
)
def test_what_cannot_be_measured_or_followed_is_refused(llama, made, message):
    with pytest.raises(ph.ConfigError, match=message):
        ph.resolve_budget(llama, PruneConfig(**made))


def test_a_loss_bound_needs_a_model_it_can_measure():
    encoder = tm.build("xlm-roberta")  # no head: no labels to measure a loss on
    with pytest.raises(ph.ConfigError, match="this model has none"):
        ph.resolve_budget(encoder, config(max_loss=3))


def test_a_plan_given_whole_keeps_min_heads_per_layer_on_every_path(llama):
    """The API's `prune_model(plan=...)` checks the minimum the CLI checks: one home, `resolve_budget`."""
    with pytest.raises(ph.PlanError, match="leaves model.layers.0.self_attn with 0 heads, below min_heads_per_layer=1"):
        ph.resolve_budget(llama, config(), plan={0: [0, 1, 2, 3]})
    emptied = ph.resolve_budget(llama, config(min_heads_per_layer=0), plan={0: [0, 1, 2, 3]})
    assert emptied.removes == 4
