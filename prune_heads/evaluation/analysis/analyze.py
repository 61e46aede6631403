"""`analyze`: where a model's heads matter, which repeat each other, what each does and what a cut would cost,
from one forward and backward pass over the data and one forward pass's worth of measured cuts."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn

from ...config import DEFAULT_METHOD
from ...errors import ConfigError
from ...model.gates import head_gates
from ...model.hooks import hooks
from ...model.layers import AttentionLayer, require_attention
from ...model.onload import onload_offloaded
from ...runtime.devices import input_device, on_device_of, to_device
from ...runtime.memory import release_freed_memory
from ...runtime.progress import progress_bar
from ...runtime.work import Pricer
from ...scoring.methods import head_scores
from ...scoring.objective import Objective, Reference, encoder_probe, frozen
from ...scoring.selection import HeadBudget, select_heads
from ...task_data import TaskData, batch_size, with_targets
from . import derived
from .records import Analysis, CutCost, LayerAnalysis
from .sums import BEHAVIOURS, LayerSums, layer_hooks

CUTS = (1 / 6, 1 / 3, 1 / 2, 2 / 3)  # shares of the heads (KV groups under grouped-query attention) cut
MEASURED = 2  # every MEASURED-th batch measures the cuts: CUTS over them cost at most one pass over all batches
Z = 1.959963984540054  # of a 95% normal interval


@dataclass(frozen=True)
class Kept:
    """A batch the cuts are measured on, on the CPU, with the unpruned model's outputs as `divergence` takes them."""

    batch: dict
    reference: Reference


@contextmanager
def eager(model: nn.Module) -> Iterator[None]:
    """The model's attention run by transformers' eager implementation inside (the one that returns the
    attention weights), its own again on exit."""
    config = getattr(model, "config", None)
    own = getattr(config, "_attn_implementation", None)
    if own in (None, "eager") or not hasattr(model, "set_attn_implementation"):
        yield
        return
    switch = cast(Callable[[str], None], model.set_attn_implementation)  # transformers' PreTrainedModel
    switch("eager")
    try:
        yield
    finally:
        switch(own)


def _gradients(gates, losses: torch.Tensor) -> list[torch.Tensor]:
    grads = torch.autograd.grad(losses.sum(), list(gates), allow_unused=True)
    return [(torch.zeros_like(g) if d is None else d).detach().double().cpu() for g, d in zip(gates, grads)]


def _pass(
    model, layers, batches, objective, seed: int, progress: bool
) -> tuple[list[LayerSums], list[int], list[Kept]]:
    """One forward and backward pass with per-example gates: each layer's sums and per-batch squared gradients
    (the fisher score's terms), each batch's examples, and every MEASURED-th batch (the second, fourth, ...: at
    most 1 / MEASURED of them; a lone batch itself) kept with its reference."""
    sums = [LayerSums.of(layer) for layer in layers]
    mask: list[torch.Tensor | None] = [None]
    device, generator = input_device(model), torch.Generator()
    examples, kept = [], []
    registered = itertools.chain.from_iterable(layer_hooks(s, mask) for s in sums)
    with frozen(model), eager(model), head_gates(model) as gates, hooks(registered):
        for index, batch in enumerate(progress_bar(batches, "analysing heads", len(batches), progress)):
            generator.manual_seed(seed * 1_000_003 + index)
            batch = to_device(batch, device)
            mask[0] = batch.get("attention_mask")
            gates.reset(batch_size=batch_size(batch))
            outputs = model(**objective.inputs(batch), output_attentions=True)
            if index % MEASURED == MEASURED - 1 or len(batches) == 1:
                reference = objective.reference(outputs, batch)
                on_cpu = to_device(batch, "cpu")
                kept.append(Kept(on_cpu, on_device_of(reference, on_cpu)))
            losses = objective.per_example(outputs, batch, generator)
            for layer_sums, grad in zip(sums, _gradients(gates, losses)):
                layer_sums.fisher.append((grad**2).sum(0))
            examples.append(batch_size(batch))
            del outputs, losses
            release_freed_memory()
    return sums, examples, kept


def _cut_plans(scores, layers: list[AttentionLayer]) -> list[tuple[int, dict[str, list[int]]]]:
    """(units, plan) for each of CUTS: the least important heads, or whole KV groups under grouped-query
    attention, as the default selection takes them from these scores alone (the nearest count it can reach; a
    layer may lose every head where one KV group is the whole layer)."""
    size = max(layer.group_size for layer in layers)
    units = sum(layer.num_heads for layer in layers) // size
    whole = any(len(layer.kv_heads) == 1 and layer.group_size > 1 for layer in layers)  # a KV group is a block
    found, seen = [], set()
    for share in CUTS:
        wanted = max(1, round(share * units)) * size
        plan = select_heads(scores, HeadBudget(num_heads=wanted, round="nearest", min_heads_per_layer=int(not whole)))
        key = tuple(sorted((k, tuple(v)) for k, v in plan.items()))
        if key not in seen and any(plan.values()):
            seen.add(key)
            found.append((sum(len(v) for v in plan.values()) // size, plan))
    return found


@torch.no_grad()
def _cut_cost(model, layers, objective, kept: list[Kept], units: int, plan: dict[str, list[int]]) -> CutCost:
    """The per-example divergence from the unpruned model with the plan's heads gated off, on the kept batches."""
    device, values = input_device(model), []
    with head_gates(model, requires_grad=False) as gates:
        for i, layer in enumerate(layers):
            for head in plan.get(layer.name, []):
                gates[i][layer.heads.index(head)] = 0.0
        for one in kept:
            batch = to_device(one.batch, device)
            outputs = model(**objective.inputs(batch))
            values.append(objective.divergence(outputs, batch, on_device_of(one.reference, batch)).double().cpu())
    found = torch.cat(values)
    spread = Z * float(found.std()) / max(len(found), 1) ** 0.5 if len(found) > 1 else 0.0
    mean = float(found.mean())
    heads = sum(len(v) for v in plan.values())
    written = tuple((name, tuple(plan[name])) for name in plan if plan[name])
    return CutCost(units, heads, mean, mean - spread, mean + spread, len(found), written)


def _layer(sums: LayerSums, found: derived.Importance, start: int) -> LayerAnalysis:
    """The layer's record, its heads at `start` onward in the model's order of `found`."""
    layer, span = sums.layer, slice(start, start + sums.layer.num_heads)
    kv = len(layer.kv_heads)
    behaviour = (sums.behaviour / max(sums.queries, 1)).tolist()
    measured = {
        name: tuple(round(x, 6) for x in row) if sums.queries else None for name, row in zip(BEHAVIOURS, behaviour)
    }
    written = (sums.gram.diagonal().clamp_min(0) / max(sums.tokens, 1)).sqrt()
    return LayerAnalysis(
        name=layer.name,
        heads=tuple(layer.heads),
        kv_heads=tuple(layer.kv_heads),
        group_size=layer.group_size,
        importance=tuple(float(x) for x in found.value[span]),
        low=tuple(float(x) for x in found.low[span]),
        high=tuple(float(x) for x in found.high[span]),
        rank=tuple(int(x) for x in found.rank[span]),
        rank_low=tuple(int(x) for x in found.rank_low[span]),
        rank_high=tuple(int(x) for x in found.rank_high[span]),
        written=tuple(round(float(x), 6) for x in written),
        similarity=derived.cosines(sums.gram),
        key_share=derived.key_shares(sums.keys) if sums.keys is not None else None,
        value_share=derived.value_shares(sums.values, kv) if sums.values is not None else None,
        **measured,
    )


def _batches(data: TaskData | Iterable[dict]) -> list[dict]:
    batches = with_targets(data) if isinstance(data, TaskData) else list(data)
    if not batches or not sum(batch_size(b) for b in batches):
        raise ConfigError("the data has no rows after tokenization: give a split with text in the text column")
    return batches


def analyze(model: nn.Module, data: TaskData | Iterable[dict], seed: int = 0, progress: bool = True) -> Analysis:
    """Measure where `model`'s heads matter and where they repeat each other, on the batches of `data` (as
    `score_heads` takes them): each head's importance (the default scoring method, per example) with its
    interval and rank range over resampled batches; how alike the heads of each layer write (and, under
    grouped-query attention, its KV heads' keys and values), the near-duplicate pairs; each head's attention
    entropy, distance and first / previous / same-token shares; and the divergence from the unpruned model
    when the least important sixth, third, half and two thirds of the heads (KV groups) go. One forward and
    backward pass, then the cuts on every second batch: two fisher passes' work. The model computes as it did
    (weights accelerate offloaded are made CPU tensors run on its execution device, as `prune_model` does)."""
    batches = _batches(data)
    layers = require_attention(model)
    onload_offloaded(model)  # weights accelerate offloads to the meta device: read where they are, as scoring does
    probe = encoder_probe(model, batches, input_device(model))
    objective = Objective(model, None, probe)
    with frozen(model):  # torch's FLOP counter refuses some models whose weights need gradients
        pricer = Pricer.of(model, batches[0])
    sums, examples, kept = _pass(model, layers, batches, objective, seed, progress)
    per_batch = torch.stack([torch.cat([s.fisher[b] for s in sums]) for b in range(len(batches))]).numpy()
    found = derived.importance(per_batch, np.array(examples, dtype=np.float64), seed)
    starts = np.cumsum([0] + [layer.num_heads for layer in layers])
    records = tuple(_layer(s, found, int(start)) for s, start in zip(sums, starts))
    scores = head_scores(
        DEFAULT_METHOD, layers, [torch.from_numpy(found.value[a:b]) for a, b in zip(starts, starts[1:])], sum(examples)
    )
    costs = tuple(
        _cut_cost(model, layers, objective, kept, units, plan)
        for units, plan in progress_bar(_cut_plans(scores, layers), "measuring cuts", None, progress)
    )
    pairs = [
        derived.head_pairs(s, r.similarity) + derived.kv_pairs(s, r.key_share, r.value_share)
        for s, r in zip(sums, records)
    ]
    work = pricer.forward_backward(batches) + len(costs) * pricer.forward([k.batch for k in kept])
    return Analysis(
        model=str(getattr(model, "name_or_path", "") or type(model).__name__),
        method=DEFAULT_METHOD,
        examples=sum(examples),
        batches=len(batches),
        unit="KV group" if max(layer.group_size for layer in layers) > 1 else "head",
        layers=records,
        duplicates=tuple(itertools.chain.from_iterable(pairs)),
        costs=costs,
        rank_agreement=round(found.agreement, 6),
        passes=round(work / pricer.forward_backward(batches), 4),
    )
