"""Turning head scores into a plan for `prune`: which heads to remove."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from .scoring import HeadScores
from .surgery import PlanError


@dataclass(frozen=True)
class _Unit:
    """Heads that go together: one head, a whole KV group, or one head from every KV group."""

    layer: str
    heads: tuple[int, ...]
    score: float
    round: int | None = None  # uniform-GQA rounds of one layer must go in order


def _units(name: str, heads: tuple[int, ...], scores: torch.Tensor, group: int, gqa: str) -> list[_Unit]:
    if group == 1:
        return [_Unit(name, (h,), float(s)) for h, s in zip(heads, scores)]
    groups: dict[int, list[tuple[float, int]]] = {}
    for h, s in zip(heads, scores.tolist()):
        groups.setdefault(h // group, []).append((s, h))
    if gqa == "groups":
        return [_Unit(name, tuple(h for _, h in members), sum(s for s, _ in members) / len(members))
                for members in groups.values()]
    ranked = [sorted(members) for members in groups.values()]
    return [_Unit(name, tuple(m[k][1] for m in ranked), sum(m[k][0] for m in ranked) / len(ranked), k)
            for k in range(len(ranked[0]))]


def _take(units: list[_Unit], budget: int, room: dict[str, int]) -> list[_Unit]:
    """Greedily take the lowest-scoring units whose layer has room, up to `budget` heads; uniform-GQA rounds
    of a layer are taken in order."""
    taken, removed, next_round = [], 0, {}
    for unit in sorted(units, key=lambda u: (u.score, u.round or 0)):
        size = len(unit.heads)
        in_order = unit.round is None or unit.round == next_round.get(unit.layer, 0)
        if removed + size > budget or size > room[unit.layer] or not in_order:
            if unit.round is not None and in_order:
                next_round[unit.layer] = -1  # a skipped round blocks the later ones
            continue
        taken.append(unit)
        removed += size
        room[unit.layer] -= size
        if unit.round is not None:
            next_round[unit.layer] = unit.round + 1
        if removed == budget:
            break
    return taken


def _uniform_keep(scores: HeadScores, names: list[str], present: dict[str, int], sparsity: float | None,
                  num_heads: int | None, keep_per_layer, gqa: str) -> int:
    """The number of heads every layer keeps under `uniform=True`."""
    if names != scores.layers:
        raise PlanError("uniform=True prunes every layer alike; drop ignore, or pass uniform=False")
    shapes = {(present[n], len({h // scores.group_sizes[n] for h in scores.heads[n]})) for n in names}
    if len(shapes) != 1:
        raise PlanError(f"uniform=True needs layers that have the same heads now; they have {sorted(shapes)} "
                        f"(present heads, KV groups)")
    heads, groups = shapes.pop()
    if isinstance(keep_per_layer, dict):
        if len(set(keep_per_layer.values())) != 1 or set(keep_per_layer) != set(names):
            raise PlanError("uniform=True takes keep_per_layer as one number for every layer")
        keep_per_layer = next(iter(keep_per_layer.values()))
    if keep_per_layer is not None:
        remove = heads - keep_per_layer
    elif num_heads is not None:
        remove = num_heads / len(names)
    else:
        total = sum(scores.original_heads.values())
        remove = (sparsity * total - (total - heads * len(names))) / len(names)
    grouped = any(scores.group_sizes[n] > 1 for n in names)
    unit = 1 if not grouped else heads // groups if gqa == "groups" else groups
    return heads - unit * math.floor(remove / unit + 0.5)


def select_heads(scores: HeadScores, sparsity: float | None = None, num_heads: int | None = None,
                 keep_per_layer: int | dict[str, int] | None = None, scope: str = "global",
                 min_heads_per_layer: int = 1, ignore: str | list[str] | None = None,
                 gqa: str = "groups", uniform: bool = False) -> dict[str, list[int]]:
    """Choose the least important heads to remove; returns `{layer name: [original heads]}` for `prune`.

    Give exactly one of: `sparsity`, the fraction of all ORIGINAL heads that should be gone afterwards
    (heads already removed count); `num_heads`, how many more heads to remove; `keep_per_layer`, how many
    heads each layer keeps (an int, or a dict by layer name). `scope` "global" ranks heads across layers,
    "layer" removes the same fraction from every layer. `min_heads_per_layer` (0 allows removing whole
    attention layers) and `ignore` (regexes on layer names) protect layers. Grouped-query layers lose whole
    KV groups (`gqa="groups"`) or the same number of query heads from every group (`gqa="uniform"`).
    `uniform=True` makes every layer keep the same number of heads and KV heads (each layer's own least
    important ones go), the count rounded to whole units (a KV group, or one head from every group), so
    Llama-style models save with a stock config (see `save_pruned`).
    Raises PlanError for a request that cannot be met, saying what is possible.
    """
    if sum(x is not None for x in (sparsity, num_heads, keep_per_layer)) != 1:
        raise PlanError("give exactly one of sparsity, num_heads or keep_per_layer")
    if scope not in ("global", "layer"):
        raise PlanError(f"scope must be 'global' or 'layer', not {scope!r}")
    if gqa not in ("groups", "uniform"):
        raise PlanError(f"gqa must be 'groups' or 'uniform', not {gqa!r}")
    if sparsity is not None and not 0 <= sparsity <= 1:
        raise PlanError(f"sparsity must be between 0 and 1, not {sparsity}")
    patterns = [ignore] if isinstance(ignore, str) else list(ignore or [])
    names = [n for n in scores.layers if not any(re.search(p, n) for p in patterns)]
    present = {n: len(scores.heads[n]) for n in scores.layers}
    room = {n: max(present[n] - min_heads_per_layer, 0) for n in names}
    units = {n: _units(n, scores.heads[n], scores.scores[n], scores.group_sizes[n], gqa) for n in names}
    total_original = sum(scores.original_heads.values())
    already = total_original - sum(present.values())
    if uniform:
        keep_per_layer = _uniform_keep(scores, names, present, sparsity, num_heads, keep_per_layer, gqa)
        sparsity = num_heads = None

    if keep_per_layer is not None:
        keep = keep_per_layer if isinstance(keep_per_layer, dict) else {n: keep_per_layer for n in names}
        budgets = {n: present[n] - keep.get(n, present[n]) for n in names}
        bad = [n for n, b in budgets.items() if b < 0 or b > room[n]]
        if bad:
            raise PlanError(f"keep_per_layer cannot be met for {bad[0]}: it has {present[bad[0]]} heads and must "
                            f"keep at least {min_heads_per_layer} (min_heads_per_layer)")
        taken = [u for n in names for u in _take(units[n], budgets[n], dict(room))]
    elif scope == "layer":
        if num_heads is not None:
            raise PlanError("num_heads needs scope='global'; with scope='layer' give sparsity or keep_per_layer")
        taken = []
        for n in names:
            budget = round(sparsity * scores.original_heads[n]) - (scores.original_heads[n] - present[n])
            if budget > room[n]:
                raise PlanError(f"sparsity {sparsity} asks {n} to lose {budget} more heads but only {room[n]} can "
                                f"go with min_heads_per_layer={min_heads_per_layer}; lower one of them")
            taken += _take(units[n], max(budget, 0), dict(room))
    else:
        budget = num_heads if num_heads is not None else round(sparsity * total_original) - already
        possible = sum(room.values())
        if budget > possible:
            what = f"{num_heads} heads" if num_heads is not None else f"sparsity {sparsity} ({budget} more heads)"
            raise PlanError(f"cannot remove {what}: with min_heads_per_layer={min_heads_per_layer}"
                            f"{' and ignore=' + repr(patterns) if patterns else ''} at most {possible} can go "
                            f"(sparsity {(already + possible) / total_original:.3f}); ask for less")
        if budget < 0:
            raise PlanError(f"the model already misses {already} of {total_original} heads, more than sparsity "
                            f"{sparsity} asks for")
        taken = _take([u for n in names for u in units[n]], budget, dict(room))
    plan: dict[str, list[int]] = {}
    for unit in taken:
        plan.setdefault(unit.layer, []).extend(unit.heads)
    return {n: sorted(plan[n]) for n in scores.layers if n in plan}
