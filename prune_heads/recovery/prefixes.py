"""Prefixes of one nested order of units (the search's, each prefix a plan of its own): the most units a
quality bound allows (`selection.max_loss`), found by bisection over the prefix lengths, and the frontier of
asked depths (`selection.depths`), each measured once, so a handful of held-out passes price every depth
instead of a prune per depth."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

from ..model.kv_sharing import Merges, written_plan
from ..scoring.head_scores import HeadScores
from ..scoring.selection import HeadBudget, removal_units
from .search import Unit


@dataclass(frozen=True)
class Depth:
    """One depth of a frontier: the share of heads asked, the units and heads its prefix removes (each pruned
    layer refitted, before tuning), the held-out perplexity change with its 95% interval (and on a second
    text where one was given), the KV cache in bytes per llama.cpp cache type, the parameters left and the
    plan (original head indices per layer); with `sharing`, the KV heads it shares in layers the plan leaves
    whole, and `shared`, the same depth with some of its emptied groups' query heads kept so (the same cache)."""

    share: float
    units: int
    heads: int
    perplexity_change: float
    interval: tuple[float, float]
    eval_change: float | None
    eval_interval: tuple[float, float] | None
    kv_cache: dict[str, int]
    parameters: int
    plan: dict[str, list[int]]
    sharing: dict[str, Merges] = field(default_factory=dict)
    shared: Depth | None = None

    @property
    def plan_file(self) -> str:
        """Where its plan is written beside the pruned model (frontier/plan-1-3.json, a shared one's
        frontier/plan-1-3-shared.json), for `--plan`."""
        share = Fraction(self.share).limit_denominator(1000)
        return f"frontier/plan-{share.numerator}-{share.denominator}{'-shared' if self.sharing else ''}.json"

    @property
    def written_plan(self) -> dict:
        """Its plan with the KV heads it shares, as its plan file holds it."""
        return written_plan(self.plan, self.sharing)


def prefix_length(order: list[Unit], heads: int) -> int | None:
    """How many units of `order` remove exactly `heads` heads (None where no prefix does)."""
    removed = 0
    for count, (_, unit) in enumerate(order):
        if removed == heads:
            return count
        removed += len(unit)
    return len(order) if removed == heads else None


def ranked_order(scores: HeadScores, budget: HeadBudget, heads: int) -> list[Unit]:
    """The plain ranking as one nested order, where no search gives one: the units selection may remove at
    `budget`, lowest summed score first (as the ranking weighs a unit), each layer's taken while it may lose
    them, up to `heads` heads."""
    position = {name: {h: i for i, h in enumerate(kept)} for name, kept in scores.heads.items()}
    units = removal_units(scores, budget)

    def cost(unit: Unit) -> float:
        name, members = unit
        return sum(float(scores.scores[name][position[name][h]]) for h in members)

    order: list[Unit] = []
    lost: dict[str, int] = {}
    for name, unit in sorted(((n, u) for n, (us, _) in units.items() for u in us), key=cost):
        if sum(lost.values()) + len(unit) > heads:
            break
        if lost.get(name, 0) + len(unit) <= units[name][1]:
            order.append((name, unit))
            lost[name] = lost.get(name, 0) + len(unit)
    return order


def prefix_plan(order: list[Unit], count: int) -> dict[str, list[int]]:
    """The plan that removes the first `count` units of `order`."""
    plan: dict[str, list[int]] = {}
    for name, unit in order[:count]:
        plan[name] = sorted([*plan.get(name, []), *unit])
    return plan


def deepest_within(count: int, rise: Callable[[int], float], bound: float) -> tuple[int, dict[int, float]]:
    """The longest prefix, of lengths 0 to `count`, whose `rise(length)` is at most `bound` (the empty one
    always is), and every rise measured. Bisection, about log2(count) + 1 measurements: removing more units
    along one order costs more, so the rise crosses the bound once; where measured rises are not monotone, the
    length returned still has its own rise within the bound and the next longer one above it."""
    if count == 0:
        return 0, {}
    measured = {count: rise(count)}
    if measured[count] <= bound:
        return count, measured
    low, high = 0, count  # low within the bound (0: nothing removed), high above it
    while high - low > 1:
        middle = (low + high) // 2
        measured[middle] = rise(middle)
        low, high = (middle, high) if measured[middle] <= bound else (low, middle)
    return low, measured
