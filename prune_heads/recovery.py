"""Retraining-free recovery after head removal.

- `plan_with_interactions`: Kwon et al. (2022)'s mask rearrangement, done exactly: per layer, the block of
  the Fisher matrix (per-example gate gradients, g g^T) estimates the loss increase of removing a SET of
  heads, 1_S^T F 1_S / 2, including their interactions; the best set per size is found by enumeration and the
  sizes are shared out between layers by dynamic programming.
- `reconstruct`: mask tuning (Kwon et al. 2022) and bias compensation (FLAP, An et al. 2024) as one least-squares
  problem per layer: scales for the kept heads and/or a new output bias so that the pruned layer's output
  projection matches the unpruned layer's on the calibration set. Layers are solved in order on the pruned
  model's own inputs, so drift from earlier layers is corrected too. The scales are folded into the output
  projection, so the saved model is a plain smaller model.
- `tune_gates`: one scale per kept head, tuned by Adam so the pruned model's OUTPUTS match the unpruned
  model's (KL on logits), then folded the same way. On the fixture this recovers more than the layer-wise
  least squares, which match layer outputs the task does not fully depend on (see benchmarks/README.md).
"""

from __future__ import annotations

import itertools
import math
from typing import Iterable

import torch
from torch import nn

from .data import input_device, to_device
from .layers import AttentionLayer, find_attention, resolve, weight_matrix
from .scoring import HeadScores
from .surgery import PlanError

_MAX_ENUMERATED = 20_000  # subsets of one layer's units, beyond which the set is grown greedily


def _best_sets(block: torch.Tensor, heads: tuple[int, ...], group: int) -> list[tuple[float, tuple[int, ...]]]:
    """For k = 0..H removed units: the smallest estimated loss increase and the heads to remove.

    Units are single heads, or whole KV groups in grouped-query layers. Enumerates every subset when that
    is cheap, and grows the set greedily otherwise.
    """
    units: dict[int, list[int]] = {}
    for position, h in enumerate(heads):
        units.setdefault(h // group, []).append(position)
    members = list(units.values())
    best = [(0.0, ())]
    chosen: list[int] = []
    for k in range(1, len(members) + 1):
        def cost(subset):
            index = [p for u in subset for p in members[u]]
            return float(block[index][:, index].sum()) / 2

        if math.comb(len(members), k) <= _MAX_ENUMERATED:
            value, subset = min((cost(s), s) for s in itertools.combinations(range(len(members)), k))
        else:
            value, extra = min((cost((*chosen, u)), u) for u in range(len(members)) if u not in chosen)
            subset = (*chosen, extra)
        chosen = list(subset)
        best.append((value, tuple(sorted(heads[p] for u in subset for p in members[u]))))
    return best


def plan_with_interactions(scores: HeadScores, num_heads: int | None = None, sparsity: float | None = None,
                           min_heads_per_layer: int = 1) -> dict[str, list[int]]:
    """The removal plan that minimises the block-diagonal Fisher estimate of the loss increase.

    Needs scores from the "fisher" method (they carry each layer's Fisher block). Give `num_heads` (how
    many more to remove) or `sparsity` (fraction of all original heads gone afterwards). Grouped-query
    layers lose whole KV groups. Raises PlanError when the request cannot be met.
    """
    blocks = scores.meta.get("fisher_blocks")
    if blocks is None:
        raise PlanError("mask rearrangement needs scores from method='fisher' (they carry the Fisher blocks)")
    present = {n: len(scores.heads[n]) for n in scores.layers}
    total = sum(scores.original_heads.values())
    already = total - sum(present.values())
    asked = f"{num_heads} heads" if num_heads is not None else None
    if num_heads is None:
        num_heads = round((sparsity or 0.0) * total) - already
        asked = f"sparsity {sparsity} ({num_heads} more heads)"
    options = {}
    for name in scores.layers:
        block = torch.as_tensor(blocks[name], dtype=torch.float64)
        options[name] = [(c, s) for c, s in _best_sets(block, scores.heads[name], scores.group_sizes[name])
                         if present[name] - len(s) >= min_heads_per_layer]
    # dp[r] = (cost, choices) of removing exactly r heads from the layers seen so far
    dp: dict[int, tuple[float, list[tuple[int, ...]]]] = {0: (0.0, [])}
    for name in scores.layers:
        nxt: dict[int, tuple[float, list[tuple[int, ...]]]] = {}
        for removed, (so_far, picks) in dp.items():
            for cost, subset in options[name]:
                r = removed + len(subset)
                if r <= num_heads and (r not in nxt or so_far + cost < nxt[r][0]):
                    nxt[r] = (so_far + cost, picks + [subset])
        dp = nxt
    if num_heads not in dp:
        possible = max(r for r in dp if r <= num_heads)
        raise PlanError(f"cannot remove {asked}: with min_heads_per_layer={min_heads_per_layer} and whole KV groups "
                        f"at most {possible} can go (sparsity {(already + possible) / total:.3f}); ask for less")
    return {n: list(s) for n, s in zip(scores.layers, dp[num_heads][1]) if s}


def _rows(x: torch.Tensor, batch: dict) -> torch.Tensor:
    """Token rows of a [batch, seq, features] activation, padding dropped."""
    mask = batch.get("attention_mask")
    if mask is not None and x.dim() == 3 and mask.shape == x.shape[:2]:
        return x[mask.bool()]
    return x.reshape(-1, x.shape[-1])


class _Statistics:
    """Sums over calibration tokens of x x^T, x y^T, x, y and |y|^2 for one layer, where x is the pruned
    layer's output-projection input and y the unpruned layer's output-projection output."""

    def __init__(self, inner: int, width: int) -> None:
        self.C = torch.zeros(inner, inner, dtype=torch.float64)
        self.P = torch.zeros(inner, width, dtype=torch.float64)
        self.sx, self.sy = torch.zeros(inner, dtype=torch.float64), torch.zeros(width, dtype=torch.float64)
        self.yy, self.n = 0.0, 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.double().cpu(), y.double().cpu()
        self.C += x.T @ x
        self.P += x.T @ y
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.yy += float((y * y).sum())
        self.n += y.shape[0]


@torch.no_grad()
def _collect(model: nn.Module, reference: nn.Module, pairs: list[tuple[AttentionLayer, AttentionLayer]],
             batches: list[dict]) -> list[_Statistics]:
    """One forward of each model per batch, with hooks on the output projections of every layer in `pairs`."""
    stats = [_Statistics(l.num_heads * l.head_dim, weight_matrix(resolve(l.module, l.spec.o)).shape[0]) for l, _ in pairs]
    xs: dict[int, torch.Tensor] = {}
    ys: dict[int, torch.Tensor] = {}
    handles = []
    for i, (layer, ref_layer) in enumerate(pairs):
        handles.append(resolve(layer.module, layer.spec.o).register_forward_pre_hook(
            lambda m, a, i=i: xs.__setitem__(i, a[0].detach())))
        handles.append(resolve(ref_layer.module, ref_layer.spec.o).register_forward_hook(
            lambda m, a, out, i=i: ys.__setitem__(i, out.detach())))
    try:
        for batch in batches:
            xs.clear()
            ys.clear()
            reference(**batch)
            model(**batch)
            for i, (layer, _) in enumerate(pairs):
                y = _rows(ys[i], batch)
                x = _rows(xs[i], batch) if layer.num_heads else y.new_zeros(y.shape[0], 0)  # no heads: bias only
                stats[i].add(x, y)
    finally:
        for handle in handles:
            handle.remove()
    return stats


def _fold_scales(layer: AttentionLayer, scales: torch.Tensor) -> None:
    """Multiply each kept head's output-projection columns by its scale (exact: gates are linear there)."""
    o_proj = resolve(layer.module, layer.spec.o)
    factor = scales.detach().repeat_interleave(layer.head_dim).to(o_proj.weight.dtype).to(o_proj.weight.device)
    o_proj.weight.mul_(factor[None, :] if isinstance(o_proj, nn.Linear) else factor[:, None])


@torch.no_grad()
def _solve(layer: AttentionLayer, s: _Statistics, scales: bool, bias: bool, ridge: float) -> dict[str, float]:
    """Fit the kept heads' scales and/or the output bias to the statistics, and fold them into the layer."""
    o_proj = resolve(layer.module, layer.spec.o)
    width, dim, heads = weight_matrix(o_proj).shape[0], layer.head_dim, layer.num_heads
    inner, n = heads * dim, max(s.n, 1)
    W = weight_matrix(o_proj).detach().double().cpu()  # [width, inner]
    b_old = o_proj.bias.detach().double().cpu() if o_proj.bias is not None else torch.zeros(width, dtype=torch.float64)
    Wh = W.reshape(width, heads, dim)

    def error(m: torch.Tensor, b: torch.Tensor) -> float:
        """Mean over tokens of ||sum_h m_h A_h + b - y||^2, from the statistics."""
        Wm = (Wh * m[None, :, None]).reshape(width, inner)
        return float((Wm @ s.C * Wm).sum() - 2 * (s.P * Wm.T).sum() + s.yy + s.n * b @ b + 2 * b @ (Wm @ s.sx)
                     - 2 * b @ s.sy) / n

    ones = torch.ones(heads, dtype=torch.float64)
    before = error(ones, b_old)
    can_bias = bias and o_proj.bias is not None
    m = ones
    if scales and heads:
        Cc, Pc = (s.C - torch.outer(s.sx, s.sx) / n, s.P - torch.outer(s.sx, s.sy) / n) if can_bias else \
            (s.C, s.P - torch.outer(s.sx, b_old))
        G = torch.einsum("idje,aid,aje->ij", Cc.reshape(heads, dim, heads, dim), Wh, Wh)
        r = torch.einsum("ida,aid->i", Pc.reshape(heads, dim, width), Wh)
        lam = ridge * float(G.diagonal().mean()) + 1e-12
        m = torch.linalg.solve(G + lam * torch.eye(heads, dtype=torch.float64), r + lam * ones)
    b = b_old
    if can_bias:
        b = (s.sy - (Wh * m[None, :, None]).reshape(width, inner) @ s.sx) / n
    after = error(m, b)
    _fold_scales(layer, m)
    if can_bias:
        o_proj.bias.copy_(b.to(o_proj.bias.dtype))
    return {"error_before": before, "error_after": after, "tokens": s.n, "scales": m.tolist()}


def reconstruct(model: nn.Module, reference: nn.Module, dataloader: Iterable[dict], scales: bool = True,
                bias: bool = True, ridge: float = 1e-3, sequential: bool = False) -> dict[str, dict[str, float]]:
    """Rescale the kept heads (`scales`, mask tuning) and/or reset the output bias (`bias`, bias compensation)
    of every pruned layer so that its output matches the unpruned `reference` model's on the calibration
    batches, in place. `ridge` pulls the scales towards 1 (relative to the mean head energy). With
    `sequential`, layers are fitted one after another, each on inputs that include the earlier fits (one
    pass per layer); otherwise all layers are fitted from one pass.

    Returns, per layer, the mean squared reconstruction error per token before and after. Bias
    compensation needs an output projection with a bias (BERT-likes, GPT-2, OPT, ViT, ...); layers without
    one get scales only. `model` is the pruned copy of `reference`.
    """
    device = input_device(model)
    batches = [to_device({k: v for k, v in b.items() if k != "labels"}, device) for b in dataloader]
    layers, ref_layers = find_attention(model), {l.name: l for l in find_attention(reference)}
    was_training = (model.training, reference.training)
    model.eval()
    reference.eval()
    pairs = [(l, ref_layers[l.name]) for l in layers if l.num_heads < l.original_num_heads]
    report = {}
    try:
        for group in ([[p] for p in pairs] if sequential else [pairs]):
            for (layer, _), stats in zip(group, _collect(model, reference, group, batches)):
                report[layer.name] = _solve(layer, stats, scales, bias, ridge)
    finally:
        model.train(was_training[0])
        reference.train(was_training[1])
    return report


def tune_gates(model: nn.Module, reference: nn.Module, dataloader: Iterable[dict], epochs: int = 2,
               lr: float = 0.05, seed: int = 0, bias_lr: float | None = None) -> dict[str, list[float]]:
    """Tune one scale per kept head so the pruned model's outputs match the unpruned `reference` model's,
    then fold the scales into the output projections (the model stays a plain smaller model).

    The objective is the label-free divergence (KL on logits, 1 - cosine of pooled embeddings) over the
    calibration batches, minimised with Adam over the head gates alone: no weight matrix is trained, and
    there are as many free values as kept heads. With `bias_lr`, the output projections' biases (where they
    have one) are tuned too, at that learning rate: the same objective then also corrects the mean shift the
    removed heads leave in the residual stream (a learned bias compensation). Returns the scales per layer.
    """
    from .gates import head_gates
    from .scoring import Objective, frozen

    device = input_device(model)
    batches = [to_device({k: v for k, v in b.items() if k != "labels"}, device) for b in dataloader]
    objective = Objective(model)
    reference.eval()
    generator = torch.Generator().manual_seed(seed)
    targets: dict[int, torch.Tensor] = {}

    def target(i: int) -> torch.Tensor:
        if i in targets:
            return targets[i]
        with torch.no_grad():
            value = objective.reference(reference(**batches[i]), batches[i])
        if value.dim() <= 2:  # one vector per example: kept; per-token log-probs are recomputed (too large)
            targets[i] = value
        return value

    layers = find_attention(model)
    biases = [resolve(l.module, l.spec.o).bias for l in layers] if bias_lr else []
    biases = [b for b in biases if b is not None]
    with frozen(model), head_gates(model) as gates:  # frozen restores every requires_grad flag on exit
        for b in biases:
            b.requires_grad_(True)
        groups = [{"params": list(gates), "lr": lr}] + ([{"params": biases, "lr": bias_lr}] if biases else [])
        optimizer = torch.optim.Adam(groups)
        for _ in range(epochs):
            for i in torch.randperm(len(batches), generator=generator).tolist():
                loss = objective.divergence(model(**batches[i]), batches[i], target(i)).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scales = [g.detach().clone() for g in gates]
    with torch.no_grad():
        for layer, scale in zip(layers, scales):
            if layer.num_heads:
                _fold_scales(layer, scale)
    return {layer.name: scale.tolist() for layer, scale in zip(layers, scales)}
