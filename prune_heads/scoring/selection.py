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
from typing import Any

import torch
from torch import nn

from ..config import GQA_MODES, GRANULARITIES, ROUNDING
from ..model.inputs import dummy_inputs
from ..model.layers import find_attention, require_attention
from ..model.probe import prune
from ..model.surgery import PlanError
from ..runtime.devices import input_device, to_device
from ..runtime.work import count_flops
from .head_scores import HeadScores

STRATEGIES = ("ranked", "interactions")
_MAX_ENUMERATED = 20_000  # subsets of one layer's units, beyond which the set is grown greedily
_MAX_COSTED = 64  # the same for a cost function (each call solves a linear system)

Cost = Callable[[str, tuple[int, ...]], float]  # (layer name, removed original heads) -> cost


@dataclass(frozen=True)
class HeadBudget:
    """What `select_heads` removes: exactly one of `sparsity` (the fraction of all ORIGINAL heads gone
    afterwards, heads already removed counting), `num_heads` (how many more go) or `keep_per_layer` (heads
    each layer keeps: a number, or a dict by layer name), and the constraints it is met under. Checked when
    made, so a bad budget fails before any scores or data are touched."""

    sparsity: float | None = None
    num_heads: int | None = None
    keep_per_layer: int | dict[str, int] | None = None
    scope: str = "global"  # "layer": the same fraction from every layer
    min_heads_per_layer: int = 1  # 0 lets a layer lose every head
    ignore: str | list[str] | None = None  # regexes on layer names that keep every head
    gqa: str = "groups"  # whole KV groups, or "even": the same number of query heads from every group
    uniform: bool = False  # every layer keeps the same heads (a stock Llama config)
    granularity: str = "head"  # "layer": whole attention blocks
    strategy: str | Cost = "ranked"  # "interactions" (Fisher blocks) or a cost function
    round: str | None = None  # take the nearest reachable count ("down", "nearest", "up") instead of refusing

    def __post_init__(self) -> None:
        if self.gqa == "uniform":
            warnings.warn(
                "gqa='uniform' is now gqa='even' (the same number of query heads from every KV group)",
                DeprecationWarning,
                stacklevel=4,
            )
            object.__setattr__(self, "gqa", "even")
        self._check_choices()
        self._check_amount()
        self._check_strategy()

    def _check_choices(self) -> None:
        if sum(x is not None for x in (self.sparsity, self.num_heads, self.keep_per_layer)) != 1:
            raise PlanError("give exactly one of sparsity, num_heads or keep_per_layer")
        for value, name, choices in (
            (self.scope, "scope", ("global", "layer")),
            (self.gqa, "gqa", GQA_MODES),
            (self.granularity, "granularity", GRANULARITIES),
            (self.round, "round", (None, *ROUNDING)),
        ):
            if value not in choices:
                raise PlanError(f"{name} must be one of {', '.join(map(repr, choices))}, not {value!r}")

    def _check_amount(self) -> None:
        s, n = self.sparsity, self.num_heads
        if s is not None and not (isinstance(s, (int, float)) and 0 <= s <= 1):
            raise PlanError(f"sparsity must be between 0 and 1, not {s}")
        if n is not None and (not isinstance(n, int) or n < 0):
            raise PlanError(f"num_heads must be a whole number of heads to remove (0 or more), not {n}")
        if n is not None and self.scope == "layer":
            raise PlanError("num_heads needs scope='global'; with scope='layer' give sparsity or keep_per_layer")

    def _check_strategy(self) -> None:
        if not callable(self.strategy) and self.strategy not in STRATEGIES:
            raise PlanError(
                f"strategy must be one of {', '.join(map(repr, STRATEGIES))} or a cost function, not {self.strategy!r}"
            )
        shared = self.gqa == "groups" and not self.uniform and self.keep_per_layer is None and self.scope == "global"
        if self.strategy != "ranked" and not shared:
            named = "a cost function" if callable(self.strategy) else repr(self.strategy)
            raise PlanError(
                f"strategy={named} shares a global budget between layers: it needs scope='global', "
                "gqa='groups', uniform=False and sparsity or num_heads"
            )

    def sparse_count(self, heads: int) -> int:
        """How many of `heads` the sparsity wants gone, halves rounded up."""
        if self.sparsity is None:
            raise PlanError("this budget gives no sparsity")
        return round_half_up(self.sparsity * heads)

    @property
    def minimum(self) -> int:
        """Heads every selectable layer keeps (none when whole blocks go)."""
        return 0 if self.granularity == "layer" else self.min_heads_per_layer


def head_budget(budget: HeadBudget | None = None, **options: Any) -> HeadBudget:
    """`budget`, or one made from its fields given as keywords (`sparsity=0.3`), not both."""
    if budget is not None and options:
        raise PlanError(f"give a HeadBudget or its fields ({', '.join(options)}), not both")
    return budget if budget is not None else HeadBudget(**options)


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

    @property
    def gone(self) -> int:
        """Heads removed before."""
        return self.original - len(self.heads)


def _layers_of_scores(scores: HeadScores) -> list[_Layer]:
    return [_Layer(n, scores.heads[n], scores.group_sizes[n], scores.original_heads[n]) for n in scores.layers]


def _layers_of_model(model: nn.Module) -> list[_Layer]:
    return [_Layer(l.name, l.heads, l.group_size, l.original_num_heads) for l in require_attention(model)]


@dataclass(frozen=True)
class _Structure:
    """The layers a budget is met in: all of them, the selectable ones (`ignore` left out) and the head
    counts each selectable one may lose (whole units, its minimum kept)."""

    layers: list[_Layer]
    selectable: list[_Layer]
    counts: dict[str, list[int]]
    why: str  # what limits the reachable counts, for a refusal

    @property
    def total(self) -> int:
        return sum(l.original for l in self.layers)

    @property
    def already(self) -> int:
        return sum(l.gone for l in self.layers)


def _structure(layers: list[_Layer], budget: HeadBudget) -> _Structure:
    patterns = [budget.ignore] if isinstance(budget.ignore, str) else list(budget.ignore or [])
    selectable = [l for l in layers if not any(re.search(p, l.name) for p in patterns)]
    counts = {
        l.name: _counts(l.units(budget.gqa, budget.granularity), len(l.heads) - budget.minimum) for l in selectable
    }
    return _Structure(layers, selectable, counts, _why(selectable, budget))


def _counts(units: list[list[int]], room: int) -> list[int]:
    """Numbers of heads a layer may lose: whole units, at most `room`."""
    sizes = [len(u) for u in units]
    return [sum(sizes[:k]) for k in range(len(units) + 1) if sum(sizes[:k]) <= max(room, 0)]


def _why(layers: list[_Layer], budget: HeadBudget) -> str:
    grouped = any(l.group > 1 for l in layers)
    unit = (
        "whole attention layers"
        if budget.granularity == "layer"
        else "one head from every KV group"
        if budget.gqa == "even" and grouped
        else "whole KV groups"
        if grouped
        else "single heads"
    )
    return f"heads go as {unit}, at least {budget.minimum} kept per layer (min_heads_per_layer)" + (
        ", every layer alike (uniform)" if budget.uniform else ""
    )


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


def _target(budget: HeadBudget, s: _Structure) -> tuple[int, str]:
    """More heads a global budget asks for, and how to name it in a refusal."""
    if budget.num_heads is not None:
        return budget.num_heads, f"{budget.num_heads} heads"
    target = budget.sparse_count(s.total) - s.already
    return target, f"sparsity {budget.sparsity} ({target} more heads)"


def _wanted(budget: HeadBudget, s: _Structure) -> int | dict[str, int]:
    """The exact number of heads to remove across layers (a global budget), or per layer."""
    if budget.uniform:
        return _uniform_counts(budget, s)
    if budget.keep_per_layer is not None or budget.scope == "layer":
        return {l.name: _layer_count(budget, s, l) for l in s.selectable}
    target, asked = _target(budget, s)
    if target < 0:
        raise PlanError(
            f"the model already misses {s.already} of {s.total} heads, more than sparsity {budget.sparsity} asks for"
        )
    reachable = [0]
    for counts in s.counts.values():
        reachable = sorted({r + c for r in reachable for c in counts})
    return _resolve(target, reachable, budget.round, asked, s.total, s.already, s.why)


def _layer_count(budget: HeadBudget, s: _Structure, layer: _Layer) -> int:
    """Heads one layer loses under a per-layer budget (`keep_per_layer`, or `sparsity` with scope 'layer')."""
    keep_per_layer = budget.keep_per_layer
    if keep_per_layer is not None:
        keep = keep_per_layer.get(layer.name, len(layer.heads)) if isinstance(keep_per_layer, dict) else keep_per_layer
        target, asked = len(layer.heads) - keep, f"{len(layer.heads) - keep} heads from {layer.name} (keep {keep})"
    else:
        target = budget.sparse_count(layer.original) - layer.gone
        asked = f"sparsity {budget.sparsity} of {layer.name} ({target} more heads)"
    if target < 0:
        raise PlanError(f"{layer.name} has {len(layer.heads)} heads now; cannot keep more ({asked})")
    return _resolve(target, s.counts[layer.name], budget.round, asked, layer.original, layer.gone, s.why)


def _uniform_counts(budget: HeadBudget, s: _Structure) -> dict[str, int]:
    """The same count from every layer, which must all be selectable and alike now."""
    if len(s.selectable) != len(s.layers):
        raise PlanError("uniform=True prunes every layer alike; drop ignore, or pass uniform=False")
    shapes = {(len(l.heads), len({h // l.group for h in l.heads})) for l in s.layers}
    if len(shapes) != 1:
        raise PlanError(
            f"uniform=True needs layers that have the same heads now; they have {sorted(shapes)} "
            "(present heads, KV groups)"
        )
    common = sorted(set.intersection(*(set(c) for c in s.counts.values())))
    present, n = len(s.layers[0].heads), len(s.layers)
    keep = budget.keep_per_layer
    if isinstance(keep, dict):
        if len(set(keep.values())) != 1 or set(keep) != set(s.counts):
            raise PlanError("uniform=True takes keep_per_layer as one number for every layer")
        keep = next(iter(keep.values()))
    if keep is not None:
        asked = f"{present - keep} heads per layer"
        each = _resolve(present - keep, common, budget.round, asked, s.total, s.already, s.why)
    else:
        target, asked = _target(budget, s)
        each = _resolve(target, [c * n for c in common], budget.round, asked, s.total, s.already, s.why) // n
    return {name: each for name in s.counts}


def round_half_up(x: float) -> int:
    """x rounded to the nearest whole number, halves up (Python's round() rounds halves to even)."""
    return math.floor(x + 0.5 + 1e-9)


def check_budget(model: nn.Module, budget: HeadBudget | None = None, **options: Any) -> int:
    """Check a `select_heads` budget (a HeadBudget, or its fields as keywords) against the model's structure
    alone (no scores, no data): returns the number of heads the plan will remove, or raises PlanError naming
    the nearest reachable counts."""
    budget = head_budget(budget, **options)
    wanted = _wanted(budget, _structure(_layers_of_model(model), budget))
    return wanted if isinstance(wanted, int) else sum(wanted.values())


def unit_sizes(model: nn.Module, budget: HeadBudget) -> set[int]:
    """The sizes, in heads, of the units `budget`'s constraints remove together (a head, a KV group, a layer)
    in the layers it may prune."""
    s = _structure(_layers_of_model(model), budget)
    return {len(unit) for layer in s.selectable for unit in layer.units(budget.gqa, budget.granularity)}


def requested_heads(model: nn.Module, budget: HeadBudget) -> int:
    """How many more heads a budget asks for, before any rounding to what the structure allows."""
    layers = _layers_of_model(model)
    if budget.num_heads is not None:
        return budget.num_heads
    if budget.keep_per_layer is not None:
        keep = budget.keep_per_layer
        kept = keep if isinstance(keep, dict) else {l.name: keep for l in layers}
        return sum(len(l.heads) - kept.get(l.name, len(l.heads)) for l in layers)
    total = sum(l.original for l in layers)
    return budget.sparse_count(total) - sum(l.gone for l in layers)


def removal_units(scores: HeadScores, budget: HeadBudget) -> dict[str, tuple[list[tuple[int, ...]], int]]:
    """Per layer that selection may prune (`ignore` left out): the units it removes together, as original head
    indices (a head, a KV group, one head of every group, the whole block), and how many heads it may lose."""
    s = _structure(_layers_of_scores(scores), budget)
    return {
        l.name: (
            [tuple(l.heads[p] for p in unit) for unit in l.units(budget.gqa, budget.granularity)],
            max(len(l.heads) - budget.min_heads_per_layer, 0),
        )
        for l in s.selectable
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


def select_heads(scores: HeadScores, budget: HeadBudget | None = None, **options: Any) -> dict[str, list[int]]:
    """Choose the least important heads to remove; returns `{layer name: [original heads]}` for `prune`.

    The budget is a `HeadBudget`, or its fields as keywords: `select_heads(scores, sparsity=0.3)`. Global
    budgets are shared across layers by one dynamic programme; grouped-query layers lose whole KV groups
    (`gqa="groups"`) or the same number of query heads from every group (`gqa="even"`); `uniform=True` makes
    every layer keep the same heads (so Llama-style models save a stock config); `granularity="layer"` removes
    whole attention blocks, ranked by their summed scores. `strategy="interactions"` (scores from method
    "fisher") picks each layer's set with its Fisher block, so interactions between heads count (Kwon et al.
    2022's mask rearrangement, solved exactly per layer); a function `strategy(layer name, removed heads) ->
    cost` picks each layer's cheapest sets by that cost (structured OBS,
    `prune_heads.recovery.reconstruction.RemovalCost`). The plan removes exactly what was asked; when the
    structure cannot, PlanError names the nearest counts that it can, unless `round` says to take one of them.
    """
    budget = head_budget(budget, **options)
    if budget.strategy == "interactions" and "fisher_blocks" not in scores.meta:
        raise PlanError("strategy='interactions' needs scores from method='fisher' (they carry the Fisher blocks)")
    s = _structure(_layers_of_scores(scores), budget)
    wanted = _wanted(budget, s)
    per_layer = {}
    for layer in s.selectable:
        exact = None if isinstance(wanted, int) else wanted[layer.name]  # per-layer budgets fix each count
        found = _layer_options(layer, scores, budget, s.counts[layer.name] if exact is None else [0, exact])
        per_layer[layer.name] = found if exact is None else {exact: found[exact]}
    chosen = _share_out(per_layer, wanted if isinstance(wanted, int) else sum(wanted.values()))
    return {n: list(chosen[n]) for n in scores.layers if chosen.get(n)}


def _layer_options(
    layer: _Layer, scores: HeadScores, budget: HeadBudget, counts: list[int]
) -> dict[int, tuple[float, tuple[int, ...]]]:
    """Per count it reaches, the cheapest heads of this layer to remove under the budget's strategy."""
    units = layer.units(budget.gqa, budget.granularity)
    if callable(budget.strategy):
        cost = functools.partial(budget.strategy, layer.name)
        return _cheapest_subsets(layer, units, cost, counts, _MAX_COSTED)
    if budget.strategy == "interactions":
        block = torch.as_tensor(scores.meta["fisher_blocks"][layer.name], dtype=torch.float64)
        return _interaction_options(layer, units, block, counts)
    return _ranked_options(layer, units, scores.scores[layer.name], budget.gqa, counts)


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
