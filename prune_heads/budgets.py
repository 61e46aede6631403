"""One home for what a run is asked to remove: `resolve_budget` turns the selection a `PruneConfig` holds (heads,
a sparsity, a FLOPs, KV-cache or loss budget, a frontier's depths, or a plan given whole) into one checked
`Budget`, against the model's structure, before any data is read. The flow calls it once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from torch import nn

from .config import BUDGETS, FRONTIER, KvCacheBudget, PruneConfig, SelectionConfig, parse_depths
from .errors import ConfigError
from .model.kv_sharing import Merges, normalize_sharing, split_plan
from .model.layers import AttentionLayer, find_attention
from .model.surgery import PlanError, normalize_plan
from .recovery.generated import writes_text
from .recovery.holdout import measures_loss
from .scoring.kv_cache import heads_for_kv_cache
from .scoring.selection import HeadBudget, check_budget, heads_for_flops, requested_heads, unit_sizes


@dataclass(frozen=True)
class Budget:
    """What a run removes, checked against the structure: the `select_heads` budget (`heads`), the heads it asks
    for before rounding (`asked`) and the exact number it removes (`removes`), a plan given whole by layer name
    (`given`) with the KV heads it shares (`shared`), a frontier's depths (share, heads), and the budget the
    searched order goes to (`order`: the deepest of the budget and the depths)."""

    heads: HeadBudget
    asked: int
    removes: int
    given: dict[str, list[int]] | None = None
    depths: tuple[tuple[float, int], ...] = ()
    shared: dict[str, Merges] = field(default_factory=dict)

    @property
    def order(self) -> HeadBudget:
        """The budget the searched order is taken to: the run's, or the deepest depth where deeper."""
        if not self.depths:
            return self.heads
        deepest = max([heads for _, heads in self.depths] + [self.removes])
        return dataclasses.replace(self.heads, sparsity=None, num_heads=deepest, round=None)


def resolve_budget(model: nn.Module, config: PruneConfig, seq_len: int = 128, plan: dict | None = None) -> Budget:
    """The `Budget` of `config.selection` (or of the plan given whole) on this model, before any data is read.
    Raises ConfigError for a request the model cannot measure, PlanError naming the nearest reachable budgets
    where the structure cannot meet it exactly."""
    if plan is not None:
        return _given(model, config, plan)
    config.selection.one_budget()  # exactly one: a second would go unsaid
    depths = _depths(model, config)
    heads = _head_budget(model, config, seq_len)
    return Budget(heads, requested_heads(model, heads), check_budget(model, heads), None, depths)


def check_given(config: PruneConfig) -> None:
    """Refuse what chooses a plan beside a plan given whole: a loss bound, depths, iterative scoring."""
    asked = [k for k, v in {"max_loss": config.selection.max_loss, "depths": config.selection.depths}.items() if v]
    if asked or config.scoring.steps > 1:
        wanted = ", ".join(f"selection.{k}" for k in asked) or "scoring.steps > 1"
        raise ConfigError(f"{wanted} chooses the plan, and a plan was given: leave out one of them")


def _given(model: nn.Module, config: PruneConfig, plan: dict) -> Budget:
    """A plan given whole (`{layer index or name: [heads]}`, such as a frontier depth's, with any KV heads it
    shares): its heads by layer name and exactly that many heads as the budget. A plan replaces the search, so a
    loss bound, depths or iterative scoring beside it are refused."""
    check_given(config)
    named, shared = given_plan(find_attention(model), plan)
    check_minimum(model, named, config.selection.min_heads_per_layer)
    count = sum(map(len, named.values()))
    return Budget(HeadBudget(num_heads=count), count, count, named, shared=shared)


def check_minimum(model: nn.Module, plan: dict, minimum: int) -> None:
    """Refuse a given plan that leaves a layer with fewer than `minimum` heads (0 allows empty layers)."""
    layers = find_attention(model)
    for key, heads in normalize_plan(layers, plan).items():
        left = next(l for l in layers if l.name == key).num_heads - len(heads)
        if left < minimum:
            raise PlanError(
                f"the plan leaves {key} with {left} heads, below min_heads_per_layer={minimum}; "
                f"set it to 0 (--min-heads-per-layer 0) to allow removing whole attention layers"
            )


def given_plan(layers: list[AttentionLayer], plan: dict) -> tuple[dict[str, list[int]], dict[str, Merges]]:
    """A plan given whole as its heads removed and its KV heads shared by layer name (`split_plan`), checked
    against the structure: PlanError where a layer would do both, which the recovery does not measure."""
    removals, sharing = split_plan(plan)
    named = {n: h for n, h in normalize_plan(layers, removals).items() if h}
    shared = normalize_sharing(layers, sharing)
    both = [name for name in shared if name in named]
    if both:
        raise PlanError(
            f"the plan removes heads of {both[0]} and shares its KV heads: give each layer one of the two "
            "(ph.prune, then ph.share_kv_heads, does both without recovery)"
        )
    return named, shared


def _head_budget(model: nn.Module, config: PruneConfig, seq_len: int) -> HeadBudget:
    """The `select_heads` budget: a FLOPs, KV-cache or loss budget becomes the heads it comes to (the smallest
    reachable count that meets it; for a loss bound, the most the structure lets go), taken rounded up to what
    the structure reaches unless `round` says; then checked exact."""
    selection = config.selection
    heads = None
    if selection.flops is not None:
        heads = heads_for_flops(model, selection.flops, seq_len=seq_len)
    if selection.kv_cache is not None:
        heads = heads_for_kv_cache(model, KvCacheBudget.parse(selection.kv_cache), **_constraints(selection))
    if selection.max_loss is not None:
        heads = _deepest(model, config, "selection.max_loss")
    amounts = {k: getattr(selection, k) for k in ("sparsity", "num_heads", "keep_per_layer", "round")}
    fields = {**_constraints(selection), **{k: v for k, v in amounts.items() if v is not None}}
    if heads is not None:
        fields.update(num_heads=heads, round=selection.round or "up")
    budget = HeadBudget(**fields)
    _check_iterative(config, budget)
    check_budget(model, budget)
    return budget


def _constraints(selection: SelectionConfig) -> dict[str, Any]:
    """The fields that say how heads go (not how many), as `HeadBudget` keywords."""
    return {k: v for k, v in vars(selection).items() if k not in (*BUDGETS, *FRONTIER, "round") and v != []}


def _check_iterative(config: PruneConfig, budget: HeadBudget) -> None:
    """Iterative pruning (`scoring.steps > 1`) re-scores the pruned model: a sparsity, and no recovery."""
    if config.scoring.steps == 1:
        return
    if config.recovery.enabled:
        raise ConfigError(
            "iterative pruning (scoring.steps > 1) re-scores the pruned model, which recovery "
            "cannot follow; turn recovery off (--no-recovery, or recovery: off in a recipe)"
        )
    if budget.sparsity is None:
        raise ConfigError("iterative pruning (scoring.steps > 1) needs selection.sparsity")


def _deepest(model: nn.Module, config: PruneConfig, asked: str) -> int:
    """The most heads the structure lets go, where depths along one nested order can be measured (`asked`: a
    loss bound or a frontier): a language model (a loss bound also takes a single-label classifier, on its
    labels), recovery on with held-out batches and reconstruction, units taken one at a time. Refused
    otherwise, before any data is read."""
    selection, r = config.selection, config.recovery
    if not (writes_text(model) or asked == "selection.max_loss" and measures_loss(model)):
        measured = "a language model's held-out perplexity"
        if asked == "selection.max_loss":
            measured = "a held-out loss on labels: a language model's perplexity or a single-label classifier's"
        raise ConfigError(f"{asked} measures {measured}; this model has none: give num_heads, sparsity or flops alone")
    if not (r.enabled and r.holdout > 0 and r.reconstruction):
        raise ConfigError(
            f"{asked} measures each depth on held-out batches, each pruned layer refitted: it needs recovery on "
            "with holdout above 0 and reconstruction"
        )
    if selection.uniform or selection.scope == "layer" or selection.keep_per_layer is not None:
        raise ConfigError(f"{asked} takes units one at a time: not with uniform, scope 'layer' or keep_per_layer")
    return check_budget(model, HeadBudget(num_heads=10**9, round="down", **_constraints(selection)))


def _depths(model: nn.Module, config: PruneConfig) -> tuple[tuple[float, int], ...]:
    """Each of `selection.depths` (share, heads), none without them: measurable (as for a loss bound), exact
    under the constraints, and reached by a prefix of one order (units of one size)."""
    selection = config.selection
    if selection.depths is None:
        return ()
    _deepest(model, config, "selection.depths")
    constraints = _constraints(selection)
    sizes = unit_sizes(model, HeadBudget(num_heads=0, **constraints))
    if len(sizes) > 1:
        raise PlanError(
            f"selection.depths measures prefixes of one order of units, and this model's units differ in size "
            f"({sorted(sizes)} heads): give one budget without depths"
        )
    shares = parse_depths(selection.depths)
    return tuple((s, _depth(model, s, HeadBudget(sparsity=s, round=selection.round, **constraints))) for s in shares)


def _depth(model: nn.Module, share: float, budget: HeadBudget) -> int:
    """The heads one depth of a frontier removes, its refusal naming the depth."""
    try:
        return check_budget(model, budget)
    except PlanError as error:
        raise PlanError(f"selection.depths {Fraction(share).limit_denominator(1000)}: {error}") from None
