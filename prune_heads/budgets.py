"""The budget a `PruneConfig` sets, checked against the model's structure before any data is read: how many
heads go (a FLOPs, KV-cache or loss budget turned into heads, or a plan given whole), and the depths a frontier
measures."""

from __future__ import annotations

from fractions import Fraction

from torch import nn

from .config import PruneConfig
from .errors import ConfigError
from .model.layers import find_attention
from .model.surgery import PlanError, normalize_plan
from .recovery.generated import writes_text
from .recovery.holdout import measures_loss
from .scoring.kv_cache import KvCacheBudget, heads_for_kv_cache
from .scoring.selection import HeadBudget, check_budget, heads_for_flops, unit_sizes


def selection_budget(model: nn.Module, config: PruneConfig, seq_len: int = 128) -> HeadBudget:
    """The `select_heads` budget of `config.selection`, checked against the model's structure
    before any data is read (a FLOPs or KV-cache budget becomes the smallest reachable number of heads that
    meets it).
    Raises PlanError naming the nearest reachable budgets when the structure cannot meet the request."""
    selection = config.selection
    heads = None
    if selection.flops is not None:
        heads = heads_for_flops(model, selection.flops, seq_len=seq_len)
    if selection.kv_cache is not None:
        heads = heads_for_kv_cache(model, KvCacheBudget.parse(selection.kv_cache), **selection.constraints())
    if selection.max_loss is not None:
        heads = deepest(model, config, "selection.max_loss")
    if selection.depths is not None:
        depth_heads(model, config)
    budget = selection.budget(heads)
    if config.scoring.steps > 1:
        if config.recovery.enabled:
            raise ConfigError(
                "iterative pruning (scoring.steps > 1) re-scores the pruned model, which recovery "
                "cannot follow; turn recovery off (--no-recovery, or recovery: off in a recipe)"
            )
        if budget.sparsity is None:
            raise ConfigError("iterative pruning (scoring.steps > 1) needs selection.sparsity")
    check_budget(model, budget)
    return budget


def given_plan(model: nn.Module, config: PruneConfig, plan: dict) -> tuple[dict[str, list[int]], HeadBudget]:
    """A plan given whole (`{layer index or name: [heads]}`, such as a frontier depth's), checked against the
    model's structure and the config before any data is read: its heads by layer name, and the budget of
    exactly that many heads. A plan replaces the search, so a loss bound, depths or iterative scoring with it
    are refused."""
    check_given(config)
    named = normalize_plan(find_attention(model), plan)
    return {n: h for n, h in named.items() if h}, HeadBudget(num_heads=sum(map(len, named.values())))


def check_given(config: PruneConfig) -> None:
    """Refuse what chooses a plan beside a plan given whole: a loss bound, depths, iterative scoring."""
    asked = [k for k, v in {"max_loss": config.selection.max_loss, "depths": config.selection.depths}.items() if v]
    if asked or config.scoring.steps > 1:
        wanted = ", ".join(f"selection.{k}" for k in asked) or "scoring.steps > 1"
        raise ConfigError(f"{wanted} chooses the plan, and a plan was given: leave out one of them")


def deepest(model: nn.Module, config: PruneConfig, asked: str) -> int:
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
    return check_budget(model, HeadBudget(num_heads=10**9, round="down", **selection.constraints()))


def depth_heads(model: nn.Module, config: PruneConfig) -> list[int]:
    """The heads each of `selection.depths` removes, checked before any data is read: measurable (as for a loss
    bound), exact under the constraints, and reached by a prefix of one order (units of one size)."""
    selection = config.selection
    deepest(model, config, "selection.depths")
    constraints = selection.constraints()
    sizes = unit_sizes(model, HeadBudget(num_heads=0, **constraints))
    if len(sizes) > 1:
        raise PlanError(
            f"selection.depths measures prefixes of one order of units, and this model's units differ in size "
            f"({sorted(sizes)} heads): give one budget without depths"
        )
    shares = selection.fractions()
    return [
        _depth_heads(model, share, HeadBudget(sparsity=share, round=selection.round, **constraints)) for share in shares
    ]


def _depth_heads(model: nn.Module, share: float, budget: HeadBudget) -> int:
    """The heads one depth of a frontier removes, its refusal naming the depth."""
    try:
        return check_budget(model, budget)
    except PlanError as error:
        raise PlanError(f"selection.depths {Fraction(share).limit_denominator(1000)}: {error}") from None
