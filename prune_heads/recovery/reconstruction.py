"""Least-squares reconstruction after removal: mask tuning (Kwon et al. 2022) and bias compensation as one
least-squares problem per layer against a separate unpruned reference, folded into the output projection."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..data import input_device, to_device, without_labels
from ..model.gates import fold_gates
from ..model.hooks import Hook, hooks
from ..model.layers import AttentionLayer, find_attention, output_projection, resolve
from ..scoring.recording import token_rows


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


def _keep_input(store: dict[int, torch.Tensor], i: int) -> Callable:
    """A forward pre-hook that keeps the module's input under `i`."""
    return lambda module, args: store.__setitem__(i, args[0].detach())


def _keep_output(store: dict[int, torch.Tensor], i: int) -> Callable:
    """A forward hook that keeps the module's output under `i`."""
    return lambda module, args, output: store.__setitem__(i, output.detach())


@torch.no_grad()
def _collect(
    model: nn.Module, reference: nn.Module, pairs: list[tuple[AttentionLayer, AttentionLayer]], batches: list[dict]
) -> list[_Statistics]:
    """One forward of each model per batch, with hooks on the output projections of every layer in `pairs`."""
    stats = [_Statistics(l.num_heads * l.head_dim, output_projection(l).features("out")) for l, _ in pairs]
    xs: dict[int, torch.Tensor] = {}
    ys: dict[int, torch.Tensor] = {}
    watch: list[Hook] = [
        (resolve(l.module, l.spec.o), "forward_pre", _keep_input(xs, i)) for i, (l, _) in enumerate(pairs)
    ]
    watch += [(resolve(r.module, r.spec.o), "forward", _keep_output(ys, i)) for i, (_, r) in enumerate(pairs)]
    with hooks(watch):
        for batch in batches:
            xs.clear()
            ys.clear()
            reference(**batch)
            model(**batch)
            for i, (layer, _) in enumerate(pairs):
                y = token_rows(ys[i], batch.get("attention_mask"))
                x = token_rows(xs[i], batch.get("attention_mask")) if layer.num_heads else y.new_zeros(y.shape[0], 0)
                stats[i].add(x, y)
    return stats


@torch.no_grad()
def _solve(layer: AttentionLayer, s: _Statistics, scales: bool, bias: bool, ridge: float) -> dict[str, Any]:
    """Fit the kept heads' scales and/or the output bias to the statistics, and fold them into the layer."""
    o_proj = resolve(layer.module, layer.spec.o)
    W = output_projection(layer).matrix().detach().double().cpu()  # [width, inner]
    width, dim, heads = W.shape[0], layer.head_dim, layer.num_heads
    inner, n = heads * dim, max(s.n, 1)
    b_old = o_proj.bias.detach().double().cpu() if o_proj.bias is not None else torch.zeros(width, dtype=torch.float64)
    Wh = W.reshape(width, heads, dim)  # [width, heads, dim]: head h's columns are Wh[:, h]

    def error(m: torch.Tensor, b: torch.Tensor) -> float:
        """Mean over tokens of ||sum_h m_h A_h + b - y||^2, from the statistics."""
        Wm = (Wh * m[None, :, None]).reshape(width, inner)
        return (
            float(
                (Wm @ s.C * Wm).sum() - 2 * (s.P * Wm.T).sum() + s.yy + s.n * b @ b + 2 * b @ (Wm @ s.sx) - 2 * b @ s.sy
            )
            / n
        )

    ones = torch.ones(heads, dtype=torch.float64)
    before = error(ones, b_old)
    can_bias = bias and o_proj.bias is not None
    m = ones
    if scales and heads:
        # with a free bias the statistics are centred (the bias absorbs the means); else the old bias is fixed
        Cc, Pc = (
            (s.C - torch.outer(s.sx, s.sx) / n, s.P - torch.outer(s.sx, s.sy) / n)
            if can_bias
            else (s.C, s.P - torch.outer(s.sx, b_old))
        )  # Cc: [inner, inner], Pc: [inner, width]
        # normal equations in the scales m: G m = r, G[i, j] = <W_i x_i, W_j x_j>, r[i] = <W_i x_i, y>
        G = torch.einsum("idje,aid,aje->ij", Cc.reshape(heads, dim, heads, dim), Wh, Wh)  # [heads, heads]
        r = torch.einsum("ida,aid->i", Pc.reshape(heads, dim, width), Wh)  # [heads]
        lam = ridge * float(G.diagonal().mean()) + 1e-12
        m = torch.linalg.solve(G + lam * torch.eye(heads, dtype=torch.float64), r + lam * ones)
    b = b_old
    if can_bias:
        b = (s.sy - (Wh * m[None, :, None]).reshape(width, inner) @ s.sx) / n
    after = error(m, b)
    fold_gates(layer, m)
    if can_bias:
        o_proj.bias.copy_(b.to(o_proj.bias.dtype))
    return {"error_before": before, "error_after": after, "tokens": s.n, "scales": m.tolist()}


def reconstruct(
    model: nn.Module,
    reference: nn.Module,
    dataloader: Iterable[dict],
    scales: bool = True,
    bias: bool = True,
    ridge: float = 1e-3,
    sequential: bool = False,
) -> dict[str, dict[str, float]]:
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
    batches = [to_device(without_labels(b), device) for b in dataloader]
    layers, ref_layers = find_attention(model), {l.name: l for l in find_attention(reference)}
    was_training = (model.training, reference.training)
    model.eval()
    reference.eval()
    pairs = [(l, ref_layers[l.name]) for l in layers if l.num_heads < l.original_num_heads]
    report = {}
    try:
        for group in [[p] for p in pairs] if sequential else [pairs]:
            for (layer, _), stats in zip(group, _collect(model, reference, group, batches)):
                report[layer.name] = _solve(layer, stats, scales, bias, ridge)
    finally:
        model.train(was_training[0])
        reference.train(was_training[1])
    return report
