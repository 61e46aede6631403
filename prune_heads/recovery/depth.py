"""The depth a quality bound allows (`selection.max_loss`): along one nested order of units (the search's, each
prefix a plan of its own), the most units whose measured rise stays within the bound, found by bisection over
the prefix lengths, so a handful of held-out passes price every depth instead of a prune per depth."""

from __future__ import annotations

from collections.abc import Callable

from .search import Unit


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
