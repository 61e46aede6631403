"""Least-squares reconstruction after removal: what the removed heads wrote, rebuilt from what the kept ones
write, in closed form.

- `refit`: per pruned layer, ridge least squares for the output projection's kept columns and its bias so that
  the layer gives the unpruned layer's output on the calibration tokens, solved from the Gram matrix of its
  inputs that scoring recorded (`Moments`); the ridge pulls towards FLAP's bias compensation (its limit) and
  its strength is chosen per layer on the held-out tokens' Gram matrix (GRAIL, SlimGPT: a fit folded into
  o_proj).
- `removal_cost`: structured OBS (SlimGPT; Kurtic et al. 2023's ZipLM): the increase of that fit's error when a
  set of heads goes and the others are refitted, in closed form, for a plan that removes what the others can
  stand in for.
- `reconstruct`: mask tuning (Kwon et al. 2022) and bias compensation as one least-squares problem per layer
  against a separate unpruned reference model, folded into the output projection.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..model.gates import fold_gates
from ..model.hooks import Hook, hooks
from ..model.layers import AttentionLayer, find_attention, output_projection, resolve
from ..model.surgery import head_features
from ..runtime.devices import input_device, to_device
from ..scoring.recording import Moments, token_rows
from ..task_data import without_labels

logger = logging.getLogger("prune_heads")
RIDGES = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, math.inf)  # x the mean diagonal; inf: bias compensation itself
RIDGE_WITHOUT_HOLDOUT = 1e-2  # when no held-out tokens choose one
DAMPING = 1e-2  # of the Gram matrix's mean diagonal, added before inverting it for removal costs (GPTQ's)


@dataclass
class Refit:
    """One pruned layer's reconstruction: the output projection's kept columns `weight` [out, kept features]
    (in the weights' dtype) and its whole `bias` [out] (float64), the ridge chosen (inf: bias compensation),
    the squared error per token relative to the unpruned output's energy on the held-out tokens (on the
    calibration tokens without them) and, where the fit fell back to bias compensation, why."""

    weight: torch.Tensor
    bias: torch.Tensor
    ridge: float
    error: float
    fallback: str | None = None


def kept_and_removed(layer: AttentionLayer, removed: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Output-projection input features of the layer's kept and removed heads (positions among its heads)."""
    gone = set(removed)
    kept = [p for p, h in enumerate(layer.heads) if h not in gone]
    out = [p for p, h in enumerate(layer.heads) if h in gone]
    cpu = torch.device("cpu")
    return head_features(kept, layer.head_dim, cpu), head_features(out, layer.head_dim, cpu)


def _unpruned(layer: AttentionLayer) -> torch.Tensor:
    """[W, b] of the layer's output projection, float64 [out, in + 1] (b zeros where it has no bias)."""
    projection = output_projection(layer)
    weight = projection.matrix().detach().double().cpu()
    bias = projection.module.bias
    bias = bias.detach().double().cpu() if bias is not None else weight.new_zeros(weight.shape[0])
    return torch.cat([weight, bias[:, None]], 1)


def _energy(full: torch.Tensor, gram: torch.Tensor) -> float:
    """Sum over the Gram matrix's tokens of the unpruned output's |[W, b] x~|^2 (at least a tiny positive)."""
    return max(float((full @ gram * full).sum()), 1e-30)


def _squared_error(theta: torch.Tensor, full: torch.Tensor, columns: torch.Tensor, gram: torch.Tensor) -> float:
    """Sum over the Gram matrix's tokens of |theta z - full x~|^2, z the `columns` of x~."""
    difference = -full.clone()
    difference[:, columns] += theta
    return float((difference @ gram * difference).sum())


@torch.no_grad()
def refit(
    layer: AttentionLayer, removed: Iterable[int], calibration: Moments, heldout: Moments | None, bias: bool = True
) -> Refit:
    """The ridge least-squares fit of the kept columns of the layer's output projection and its bias to the
    unpruned layer's output on the calibration tokens (from their Gram matrix; the target is the layer's own
    output, which generalises beyond the calibration text better than chasing the unpruned model's stream).
    The ridge pulls towards bias compensation (the kept columns as they are, the removed heads' mean output
    added to the bias), scaled by the kept features' mean energy; its strength is chosen among RIDGES on the
    held-out tokens. With `bias=False` the bias stays as it is (a stock config that cannot hold an output
    bias) and only the kept columns are fitted, pulled towards themselves. A fit that cannot be trusted (fewer
    tokens than unknowns per output, features without energy, values that are not finite or overflow the
    weights' dtype) falls back to bias compensation (to the kept columns as they are without a bias) and says
    why."""
    full = _unpruned(layer)  # [out, in + 1]
    inner = full.shape[1] - 1
    kept, gone = kept_and_removed(layer, removed)
    gram = calibration.matrix()
    tokens = calibration.tokens
    mean = gram[:inner, inner] / max(tokens, 1)
    if bias:  # the kept features and the constant 1
        columns = torch.cat([kept, torch.tensor([inner])])
        prior = torch.cat([full[:, kept], (full[:, inner] + full[:, gone] @ mean[gone])[:, None]], 1)
    else:  # the bias on both sides of the fit: it cancels
        old_bias, full = full[:, inner], torch.cat([full[:, :inner], full.new_zeros(full.shape[0], 1)], 1)
        columns, prior = kept, full[:, kept]
    held = heldout.matrix() if heldout is not None and heldout.tokens else None
    judge = held if held is not None else gram
    energy = _energy(full, judge)

    dtype = output_projection(layer).module.weight.dtype

    def done(theta: torch.Tensor, ridge: float, fallback: str | None = None) -> Refit:
        error = _squared_error(theta, full, columns, judge) / energy
        weight = (theta[:, :-1] if bias else theta).to(dtype)  # as it is written into the weights: half the bytes
        return Refit(weight, theta[:, -1] if bias else old_bias, ridge, error, fallback)

    if not len(kept):  # a layer that lost every head: the least-squares bias is the mean output, the prior
        return done(prior, math.inf)
    scale = float(gram.diagonal()[kept].mean())
    if tokens < len(columns):
        return done(
            prior,
            math.inf,
            f"the fit has {len(columns)} unknowns per output and the calibration data gave "
            f"{tokens} tokens; give at least {len(columns)} tokens",
        )
    if not scale > 0:
        return done(prior, math.inf, "the kept heads' outputs carry no energy on the calibration tokens")
    values, vectors = torch.linalg.eigh(gram[columns][:, columns])  # G_kk = V diag(values) V^T, shared by ridges
    target = (full @ gram[:, columns]) @ vectors  # [W, b] G[:, k] V
    start = prior @ vectors
    ridges = RIDGES if held is not None else (RIDGE_WITHOUT_HOLDOUT,)
    best: Refit | None = None
    for ridge in ridges:
        if math.isinf(ridge):
            theta = prior
        else:
            damping = ridge * scale
            theta = ((target + damping * start) / (values + damping)) @ vectors.T
        if not torch.isfinite(theta).all() or not torch.isfinite(theta.to(dtype)).all():
            continue
        candidate = done(theta, ridge)
        if best is None or candidate.error < best.error:
            best = candidate
    if best is None or not math.isfinite(best.error):
        return done(prior, math.inf, "the least-squares system gave values that are not finite in the weights' dtype")
    return best


def refit_flops(layers: list[AttentionLayer], plan: dict[str, list[int]]) -> float:
    """The counted work of the plan's reconstruction: per pruned layer an eigendecomposition of the kept
    features' Gram matrix (9 m^3, m kept features + 1) and per ridge the fit (2 out m^2) and its error (2 out
    w^2, w the layer's input features + 1)."""
    total = 0.0
    for layer in layers:
        if plan.get(layer.name):
            out, w = output_projection(layer).features("out"), layer.num_heads * layer.head_dim + 1
            m = (layer.num_heads - len(plan[layer.name])) * layer.head_dim + 1
            total += 9 * m**3 + len(RIDGES) * (2 * out * m * m + 2 * out * w * w)
    return total


def removal_cost(layers: list[AttentionLayer], moments: list[Moments]) -> Callable[[str, tuple[int, ...]], float]:
    """Structured OBS: `cost(layer name, removed heads)` is the increase of the squared error of the layer's
    output when those heads go and the output projection's other columns and bias are refitted, tr(W_R
    ((H^-1)_RR)^-1 W_R^T) with H the Gram matrix of [x, 1] (damped by DAMPING), relative to the unpruned output's
    energy so that layers compare. Inverses are made one layer at a time, as selection asks."""
    by_name = {layer.name: (layer, m) for layer, m in zip(layers, moments)}
    cache: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}

    def inverse(name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
        if name not in cache:
            cache.clear()
            layer, m = by_name[name]
            full, gram = _unpruned(layer), m.matrix()
            inner = full.shape[1] - 1
            damped = gram.clone()
            damped[:inner, :inner] += (
                DAMPING * float(gram.diagonal()[:inner].mean()) * torch.eye(inner, dtype=gram.dtype)
            )
            cache[name] = (full, torch.linalg.pinv(damped, hermitian=True), _energy(full, gram))
        return cache[name]

    def cost(name: str, removed: tuple[int, ...]) -> float:
        full, inverted, energy = inverse(name)
        _, gone = kept_and_removed(by_name[name][0], removed)
        weight = full[:, gone]
        return float((weight @ torch.linalg.pinv(inverted[gone][:, gone], hermitian=True) * weight).sum()) / energy

    return cost


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
