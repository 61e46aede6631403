"""Turning head scores into a plan for `prune`: which heads to remove.

Every strategy gives, per layer, the cost of removing each number of heads the layer's structure allows
(whole KV groups, one head from every group, whole layers...); one dynamic programme then shares the budget
out between layers so that exactly the asked number of heads goes at the smallest total cost. A budget the
structure cannot meet is an error naming the nearest reachable values, or, with `round`, the nearest one
taken. `check_budget` does the same check from the model alone, before any data is read.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..model.inputs import dummy_inputs
from ..model.layers import find_attention, require_attention
from ..model.probe import prune
from ..model.surgery import PlanError
from ..runtime.devices import input_device, to_device
from ..runtime.work import count_flops
from .head_scores import HeadScores

GQA_MODES = ("groups", "even")  # whole KV groups, or the same number of query heads from every group
GRANULARITIES = ("head", "layer")
ROUNDING = ("down", "nearest", "up")
STRATEGIES = ("ranked", "interactions")
_MAX_ENUMERATED = 20_000  # subsets of one layer's units, beyond which the set is grown greedily
_MAX_COSTED = 64  # the same for a cost function (each call solves a linear system)


@dataclass(frozen=True)
class _Layer:
    """One layer as selection sees it: present heads (original indices) and original heads per KV group."""

    name: str
    heads: tuple[int, ...]
    group: int
    original: int

    def units(self, gqa: str, granularity: str) -> list[list[int]]:
        """Positions (into `heads`) that go together: a head, a KV group, one head per group, or all."""
        if granularity == "layer":
            return [list(range(len(self.heads)))] if self.heads else []
        if self.group == 1:
            return [[p] for p in range(len(self.heads))]
        groups: dict[int, list[int]] = {}
        for p, h in enumerate(self.heads):
            groups.setdefault(h // self.group, []).append(p)
        if gqa == "groups":
            return list(groups.values())
        return [list(round_) for round_ in zip(*groups.values())]  # "even": round k = k-th head of each group


def _layers_of_scores(scores: HeadScores) -> list[_Layer]:
    return [_Layer(n, scores.heads[n], scores.group_sizes[n], scores.original_heads[n]) for n in scores.layers]


def _layers_of_model(model: nn.Module) -> list[_Layer]:
    return [_Layer(l.name, l.heads, l.group_size, l.original_num_heads) for l in require_attention(model)]


def _validate(sparsity, num_heads, keep_per_layer, scope, gqa, granularity, strategy, round, uniform) -> str:
    if sum(x is not None for x in (sparsity, num_heads, keep_per_layer)) != 1:
        raise PlanError("give exactly one of sparsity, num_heads or keep_per_layer")
    if scope not in ("global", "layer"):
        raise PlanError(f"scope must be 'global' or 'layer', not {scope!r}")
    if gqa == "uniform":
        warnings.warn(
            "gqa='uniform' is now gqa='even' (the same number of query heads from every KV group)",
            DeprecationWarning,
            stacklevel=3,
        )
        gqa = "even"
    for value, name, choices in (
        (gqa, "gqa", GQA_MODES),
        (granularity, "granularity", GRANULARITIES),
        (round, "round", (None, *ROUNDING)),
    ):
        if value not in choices:
            raise PlanError(f"{name} must be one of {', '.join(map(repr, choices))}, not {value!r}")
    if sparsity is not None and not (isinstance(sparsity, (int, float)) and 0 <= sparsity <= 1):
        raise PlanError(f"sparsity must be between 0 and 1, not {sparsity}")
    if num_heads is not None and (not isinstance(num_heads, int) or num_heads < 0):
        raise PlanError(f"num_heads must be a whole number of heads to remove (0 or more), not {num_heads}")
    if num_heads is not None and scope == "layer":
        raise PlanError("num_heads needs scope='global'; with scope='layer' give sparsity or keep_per_layer")
    if not callable(strategy) and strategy not in STRATEGIES:
        raise PlanError(
            f"strategy must be one of {', '.join(map(repr, STRATEGIES))} or a cost function, not {strategy!r}"
        )
    named = "a cost function" if callable(strategy) else repr(strategy)
    if strategy != "ranked" and (gqa == "even" or uniform or keep_per_layer is not None or scope == "layer"):
        raise PlanError(
            f"strategy={named} shares a global budget between layers: it needs scope='global', "
            "gqa='groups', uniform=False and sparsity or num_heads"
        )
    return gqa


def _counts(layer: _Layer, units: list[list[int]], room: int) -> list[int]:
    """Numbers of heads this layer may lose: whole units, at most `room`."""
    sizes = [len(u) for u in units]
    return [sum(sizes[:k]) for k in range(len(units) + 1) if sum(sizes[:k]) <= room]


def _nearest(target: int, reachable: list[int]) -> tuple[int | None, int | None]:
    below = max((r for r in reachable if r <= target), default=None)
    above = min((r for r in reachable if r >= target), default=None)
    return below, above


def _resolve(
    target: int, reachable: list[int], round: str | None, asked: str, total: int, already: int, why: str
) -> int:
    """The count to remove: `target` itself when reachable, else the rounded one, else a PlanError."""
    if target in reachable:
        return target
    below, above = _nearest(target, reachable)
    if round == "down" and below is not None:
        return below
    if round == "up" and above is not None:
        return above
    if round == "nearest" and (below is not None or above is not None):
        return min((r for r in (below, above) if r is not None), key=lambda r: (abs(r - target), r))
    options = [f"{r} heads (sparsity {(already + r) / total:.4f})" for r in (below, above) if r is not None]
    raise PlanError(
        f"cannot remove exactly {asked}: {why}; the nearest that can go are {' or '.join(options)}; "
        f"ask for one of those, or pass round='down', 'nearest' or 'up' (--round)"
    )


def _why(layers: list[_Layer], gqa: str, granularity: str, minimum: int, uniform: bool) -> str:
    unit = (
        "whole attention layers"
        if granularity == "layer"
        else "one head from every KV group"
        if gqa == "even" and any(l.group > 1 for l in layers)
        else "whole KV groups"
        if any(l.group > 1 for l in layers)
        else "single heads"
    )
    return f"heads go as {unit}, at least {minimum} kept per layer (min_heads_per_layer)" + (
        ", every layer alike (uniform)" if uniform else ""
    )


def _budgets(
    layers: list[_Layer],
    names: list[str],
    sparsity,
    num_heads,
    keep_per_layer,
    scope,
    minimum,
    gqa,
    granularity,
    uniform,
    round,
) -> tuple[dict[str, list[int]], int | dict[str, int]]:
    """Per layer, the head counts it may lose; and the exact total (global) or per-layer counts to remove."""
    minimum = 0 if granularity == "layer" else minimum
    by_name = {l.name: l for l in layers}
    total = sum(l.original for l in layers)
    already = total - sum(len(l.heads) for l in layers)
    counts = {
        n: _counts(by_name[n], by_name[n].units(gqa, granularity), max(len(by_name[n].heads) - minimum, 0))
        for n in names
    }
    why = _why([by_name[n] for n in names], gqa, granularity, minimum, uniform)
    if uniform:
        if names != [l.name for l in layers]:
            raise PlanError("uniform=True prunes every layer alike; drop ignore, or pass uniform=False")
        shapes = {(len(l.heads), len({h // l.group for h in l.heads})) for l in layers}
        if len(shapes) != 1:
            raise PlanError(
                f"uniform=True needs layers that have the same heads now; they have {sorted(shapes)} "
                f"(present heads, KV groups)"
            )
        common = sorted(set.intersection(*(set(c) for c in counts.values())))
        present = len(layers[0].heads)
        if keep_per_layer is not None:
            if isinstance(keep_per_layer, dict):
                if len(set(keep_per_layer.values())) != 1 or set(keep_per_layer) != set(names):
                    raise PlanError("uniform=True takes keep_per_layer as one number for every layer")
                keep_per_layer = next(iter(keep_per_layer.values()))
            per_layer = _resolve(
                present - keep_per_layer,
                common,
                round,
                f"{present - keep_per_layer} heads per layer",
                total,
                already,
                why,
            )
        else:
            target = num_heads if num_heads is not None else round_half_up(sparsity * total) - already
            asked = f"{num_heads} heads" if num_heads is not None else f"sparsity {sparsity} ({target} more heads)"
            per_layer = _resolve(target, [c * len(layers) for c in common], round, asked, total, already, why) // len(
                layers
            )
        return counts, {n: per_layer for n in names}
    if keep_per_layer is not None or scope == "layer":
        wanted = {}
        for n in names:
            layer = by_name[n]
            if keep_per_layer is not None:
                keep = keep_per_layer.get(n, len(layer.heads)) if isinstance(keep_per_layer, dict) else keep_per_layer
                target, asked = len(layer.heads) - keep, f"{len(layer.heads) - keep} heads from {n} (keep {keep})"
            else:
                target = round_half_up(sparsity * layer.original) - (layer.original - len(layer.heads))
                asked = f"sparsity {sparsity} of {n} ({target} more heads)"
            if target < 0:
                raise PlanError(f"{n} has {len(layer.heads)} heads now; cannot keep more ({asked})")
            wanted[n] = _resolve(
                target, counts[n], round, asked, layer.original, layer.original - len(layer.heads), why
            )
        return counts, wanted
    target = num_heads if num_heads is not None else round_half_up(sparsity * total) - already
    asked = f"{num_heads} heads" if num_heads is not None else f"sparsity {sparsity} ({target} more heads)"
    if target < 0:
        raise PlanError(f"the model already misses {already} of {total} heads, more than sparsity {sparsity} asks for")
    reachable = [0]
    for n in names:
        reachable = sorted({r + c for r in reachable for c in counts[n]})
    return counts, _resolve(target, reachable, round, asked, total, already, why)


def round_half_up(x: float) -> int:
    """x rounded to the nearest whole number, halves up (Python's round() rounds halves to even)."""
    return math.floor(x + 0.5 + 1e-9)


def check_budget(
    model: nn.Module,
    sparsity: float | None = None,
    num_heads: int | None = None,
    keep_per_layer: int | dict[str, int] | None = None,
    scope: str = "global",
    min_heads_per_layer: int = 1,
    ignore: str | list[str] | None = None,
    gqa: str = "groups",
    uniform: bool = False,
    granularity: str = "head",
    strategy: str | Callable[[str, tuple[int, ...]], float] = "ranked",
    round: str | None = None,
) -> int:
    """Check a `select_heads` budget against the model's structure alone (no scores, no data): returns the
    number of heads the plan will remove, or raises PlanError naming the nearest reachable counts."""
    layers = _layers_of_model(model)
    gqa = _validate(sparsity, num_heads, keep_per_layer, scope, gqa, granularity, strategy, round, uniform)
    names = _kept_names(layers, ignore)
    _, wanted = _budgets(
        layers, names, sparsity, num_heads, keep_per_layer, scope, min_heads_per_layer, gqa, granularity, uniform, round
    )
    return wanted if isinstance(wanted, int) else sum(wanted.values())


def requested_heads(
    model: nn.Module,
    sparsity: float | None = None,
    num_heads: int | None = None,
    keep_per_layer: int | dict[str, int] | None = None,
    **_: object,
) -> int:
    """How many more heads a budget asks for, before any rounding to what the structure allows."""
    layers = _layers_of_model(model)
    if num_heads is not None:
        return num_heads
    if keep_per_layer is not None:
        keep = keep_per_layer if isinstance(keep_per_layer, dict) else {l.name: keep_per_layer for l in layers}
        return sum(len(l.heads) - keep.get(l.name, len(l.heads)) for l in layers)
    if sparsity is None:
        raise PlanError("give exactly one of sparsity, num_heads or keep_per_layer")
    total = sum(l.original for l in layers)
    return round_half_up(sparsity * total) - (total - sum(len(l.heads) for l in layers))


def _kept_names(layers: list[_Layer], ignore) -> list[str]:
    patterns = [ignore] if isinstance(ignore, str) else list(ignore or [])
    return [l.name for l in layers if not any(re.search(p, l.name) for p in patterns)]


def removal_units(
    scores: HeadScores,
    gqa: str = "groups",
    granularity: str = "head",
    min_heads_per_layer: int = 1,
    ignore: str | list[str] | None = None,
    **_: object,
) -> dict[str, tuple[list[tuple[int, ...]], int]]:
    """Per layer that selection may prune (`ignore` left out): the units it removes together, as original head
    indices (a head, a KV group, one head of every group, the whole block), and how many heads it may lose."""
    layers = _layers_of_scores(scores)
    names = _kept_names(layers, ignore)
    return {
        l.name: (
            [tuple(l.heads[p] for p in unit) for unit in l.units(gqa, granularity)],
            max(len(l.heads) - min_heads_per_layer, 0),
        )
        for l in layers
        if l.name in names
    }


def _ranked_options(
    layer: _Layer, units: list[list[int]], scores: torch.Tensor, gqa: str, counts: list[int]
) -> dict[int, tuple[float, tuple[int, ...]]]:
    """Removing the k lowest-scoring units (rounds of one head per group go in order of their scores)."""
    values = scores.tolist()
    cost = [sum(values[p] for p in u) for u in units]
    if gqa == "even" and layer.group > 1:  # round k removes each group's k-th weakest head
        groups = list(zip(*units))
        ranked = [sorted(g, key=lambda p: values[p]) for g in groups]
        units = [[r[k] for r in ranked] for k in range(len(units))]
        order = list(range(len(units)))
        cost = [sum(values[p] for p in u) for u in units]
    else:
        order = sorted(range(len(units)), key=lambda i: cost[i])
    options: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    so_far, removed = 0.0, []
    for i in order:
        so_far += cost[i]
        removed += units[i]
        if len(removed) in counts:
            options[len(removed)] = (so_far, tuple(sorted(layer.heads[p] for p in removed)))
    return options


def _cheapest_subsets(
    layer: _Layer, units: list[list[int]], cost: Callable[[tuple[int, ...]], float], counts: list[int], enumerated: int
) -> dict[int, tuple[float, tuple[int, ...]]]:
    """Per count, the set of units with the smallest `cost` (a function of the removed heads, original
    indices): every subset when there are at most `enumerated` of that size, else grown greedily."""
    options: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    chosen: list[int] = []

    def heads(subset) -> tuple[int, ...]:
        return tuple(sorted(layer.heads[p] for u in subset for p in units[u]))

    for k in range(1, len(units) + 1):
        if sum(len(units[u]) for u in range(k)) > max(counts):
            break
        if math.comb(len(units), k) <= enumerated:
            value, subset = min((cost(heads(s)), s) for s in itertools.combinations(range(len(units)), k))
        else:
            value, extra = min((cost(heads((*chosen, u))), u) for u in range(len(units)) if u not in chosen)
            subset = (*chosen, extra)
        chosen = list(subset)
        size = sum(len(units[u]) for u in subset)
        if size in counts:
            options[size] = (value, heads(subset))
    return options


def _interaction_options(
    layer: _Layer, units: list[list[int]], block: torch.Tensor, counts: list[int]
) -> dict[int, tuple[float, tuple[int, ...]]]:
    """Per count, the set of units with the smallest 1_S^T F 1_S / 2 (the Fisher block estimate of the loss
    increase, interactions included)."""

    def cost(removed: tuple[int, ...]) -> float:
        index = [layer.heads.index(h) for h in removed]
        return float(block[index][:, index].sum()) / 2  # block: [present heads, present heads]

    return _cheapest_subsets(layer, units, cost, counts, _MAX_ENUMERATED)


def _share_out(options: dict[str, dict[int, tuple[float, tuple[int, ...]]]], budget: int) -> dict[str, tuple]:
    """Exactly `budget` heads across layers at the smallest summed cost (dynamic programming over layers)."""
    best: dict[int, tuple[float, list[tuple[int, ...]]]] = {0: (0.0, [])}  # removed so far -> (cost, picks)
    for name in options:
        step: dict[int, tuple[float, list[tuple[int, ...]]]] = {}
        for removed, (so_far, picks) in best.items():
            for count, (cost, heads) in options[name].items():
                r = removed + count
                if r <= budget and (r not in step or so_far + cost < step[r][0]):
                    step[r] = (so_far + cost, picks + [heads])
        best = step
    if budget not in best:
        raise PlanError(f"no plan removes exactly {budget} heads under these constraints")
    return dict(zip(options, best[budget][1]))


def select_heads(
    scores: HeadScores,
    sparsity: float | None = None,
    num_heads: int | None = None,
    keep_per_layer: int | dict[str, int] | None = None,
    scope: str = "global",
    min_heads_per_layer: int = 1,
    ignore: str | list[str] | None = None,
    gqa: str = "groups",
    uniform: bool = False,
    granularity: str = "head",
    strategy: str | Callable[[str, tuple[int, ...]], float] = "ranked",
    round: str | None = None,
) -> dict[str, list[int]]:
    """Choose the least important heads to remove; returns `{layer name: [original heads]}` for `prune`.

    Give exactly one of: `sparsity`, the fraction of all ORIGINAL heads that should be gone afterwards
    (heads already removed count); `num_heads`, how many more heads to remove; `keep_per_layer`, how many
    heads each layer keeps (an int, or a dict by layer name). `scope` "global" shares the budget across
    layers, "layer" removes the same fraction from every layer. `min_heads_per_layer` (0 allows removing
    whole attention layers) and `ignore` (regexes on layer names) protect layers. Grouped-query layers lose
    whole KV groups (`gqa="groups"`) or the same number of query heads from every group (`gqa="even"`).
    `uniform=True` makes every layer keep the same heads and KV heads (so Llama-style models save a stock
    config); `granularity="layer"` removes whole attention blocks, ranked by their summed scores.
    `strategy="interactions"` (scores from method "fisher") picks each layer's set with its Fisher block, so
    interactions between heads count (Kwon et al. 2022's mask rearrangement, solved exactly per layer); a
    function `strategy(layer name, removed heads) -> cost` picks each layer's cheapest sets by that cost
    (structured OBS, `prune_heads.recovery.reconstruction.removal_cost`). The plan removes exactly what was
    asked; when the structure cannot, PlanError names the nearest counts that it can, unless `round` ("down" or
    "nearest") says to take one of them.
    """
    gqa = _validate(sparsity, num_heads, keep_per_layer, scope, gqa, granularity, strategy, round, uniform)
    blocks = scores.meta.get("fisher_blocks")
    if strategy == "interactions" and blocks is None:
        raise PlanError("strategy='interactions' needs scores from method='fisher' (they carry the Fisher blocks)")
    layers = _layers_of_scores(scores)
    names = _kept_names(layers, ignore)
    counts, wanted = _budgets(
        layers, names, sparsity, num_heads, keep_per_layer, scope, min_heads_per_layer, gqa, granularity, uniform, round
    )
    options = {}
    for layer in (l for l in layers if l.name in names):
        units = layer.units(gqa, granularity)
        allowed = counts[layer.name] if isinstance(wanted, int) else [0, wanted[layer.name]]
        if callable(strategy):
            options[layer.name] = _cheapest_subsets(
                layer, units, functools.partial(strategy, layer.name), allowed, _MAX_COSTED
            )
        elif strategy == "interactions" and blocks is not None:
            block = torch.as_tensor(blocks[layer.name], dtype=torch.float64)
            options[layer.name] = _interaction_options(layer, units, block, allowed)
        else:
            options[layer.name] = _ranked_options(layer, units, scores.scores[layer.name], gqa, allowed)
        if not isinstance(wanted, int):
            options[layer.name] = {wanted[layer.name]: options[layer.name][wanted[layer.name]]}
    total = wanted if isinstance(wanted, int) else sum(wanted.values())
    chosen = _share_out(options, total)
    return {n: list(chosen[n]) for n in scores.layers if chosen.get(n)}


def plan_with_interactions(
    scores: HeadScores,
    num_heads: int | None = None,
    sparsity: float | None = None,
    min_heads_per_layer: int = 1,
    round: str | None = None,
) -> dict[str, list[int]]:
    """`select_heads(scores, strategy="interactions", ...)`: the plan that minimises the block-diagonal
    Fisher estimate of the loss increase (needs scores from method "fisher")."""
    return select_heads(
        scores,
        sparsity=sparsity,
        num_heads=num_heads,
        min_heads_per_layer=min_heads_per_layer,
        strategy="interactions",
        round=round,
    )


def heads_for_flops(model: nn.Module, keep_flops: float, batch_size: int = 1, seq_len: int = 128) -> int:
    """How many more heads to remove so one forward pass costs at most `keep_flops` of its FLOPs now.

    Measured, not modelled: the FLOPs of the model and of a copy without any attention head, on dummy inputs
    of `batch_size` x `seq_len` (FLOPs per head grow with the sequence), give the mean cost of one head. Pass
    the result to `select_heads(num_heads=...)` or `plan_with_interactions(num_heads=...)`. Raises
    PlanError when even removing every head cannot reach the target.
    """
    if not 0 < keep_flops <= 1:
        raise PlanError(f"keep_flops must be in (0, 1], not {keep_flops}")
    inputs = to_device(dummy_inputs(model, batch_size, seq_len), input_device(model))
    total = count_flops(model, inputs)
    bare = copy.deepcopy(model)
    layers = find_attention(bare)
    prune(bare, {layer.index: list(layer.heads) for layer in layers if layer.num_heads})
    floor = count_flops(bare, inputs)
    heads = sum(layer.num_heads for layer in layers)
    if floor > keep_flops * total:
        raise PlanError(
            f"removing all {heads} heads keeps {floor / total:.3f} of the FLOPs at sequence length "
            f"{seq_len}; ask for keep_flops of at least that"
        )
    per_head = (total - floor) / max(heads, 1)
    return min(heads, math.ceil((total - keep_flops * total) / per_head - 1e-9))
