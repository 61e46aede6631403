"""Least-squares reconstruction after removal: what the removed heads wrote, rebuilt from what the kept ones
write, in closed form.

- `refit`: per pruned layer, ridge least squares for the output projection's kept columns and its bias so that
  the layer gives the unpruned layer's output on the calibration tokens, solved from the Gram matrix of its
  inputs that scoring recorded (`Moments`); the ridge pulls towards FLAP's bias compensation (its limit) and
  its strength is chosen per layer on the held-out tokens' Gram matrix (GRAIL, SlimGPT: a fit folded into
  o_proj).
- `RemovalCost`: structured OBS (SlimGPT; Kurtic et al. 2023's ZipLM): the increase of that fit's error when a
  set of heads goes and the others are refitted, in closed form, for a plan that removes what the others can
  stand in for.
- `reconstruct`: `refit` for a pruned model beside a separately loaded unpruned copy.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..model.layers import AttentionLayer, find_attention, output_projection
from ..model.surgery import head_features
from ..runtime.devices import input_device, to_device
from ..scoring.objective import Objective
from ..scoring.recording import Moments, record
from ..task_data import without_labels
from .holdout import split_holdout
from .sharing_statistics import Alternative, every_turn, shared_columns

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


def _unpruned(layer: AttentionLayer, device: torch.device) -> torch.Tensor:
    """[W, b] of the layer's output projection, float64 [out, in + 1] on `device` (b zeros where it has no
    bias)."""
    projection = output_projection(layer)
    weight = projection.matrix().detach().to(device, torch.float64)
    bias = projection.module.bias
    bias = bias.detach().to(device, torch.float64) if bias is not None else weight.new_zeros(weight.shape[0])
    return torch.cat([weight, bias[:, None]], 1)


def _extended(full: torch.Tensor, inner: int) -> torch.Tensor:
    """[W, b] widened to `inner` input features with zero weights on those past the layer's own: the target
    of a fit over statistics that record alternatives beside the layer's inputs."""
    own = full.shape[1] - 1
    if inner == own:
        return full
    wide = full.new_zeros(full.shape[0], inner + 1)
    wide[:, :own], wide[:, inner] = full[:, :own], full[:, own]
    return wide


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
    layer: AttentionLayer,
    removed: Iterable[int],
    calibration: Moments,
    heldout: Moments | None,
    bias: bool = True,
    reads: Mapping[int, int] | None = None,
    recorded: list[Alternative] | None = None,
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
    why. With `reads` (query heads re-pointed, each to the KV head it reads: `sharing.reading` of a sharing's
    merges) the statistics are those of the layer's inputs beside the alternatives `recorded` (by default every
    turn: `prune_heads.recovery.sharing_statistics`), and the re-pointed heads' columns are fitted on what they give so,
    pulled towards their removal's bias compensation."""
    shared = None
    if reads:
        shared = shared_columns(layer, removed, reads, every_turn(layer) if recorded is None else recorded)
    fit = _Fit.of(layer, removed, calibration, heldout, bias, shared)
    if not len(fit.kept):  # a layer that lost every head: the least-squares bias is the mean output, the prior
        return fit.result(fit.prior, math.inf, fit.error(fit.prior))
    gram, tokens = fit.gram, calibration.tokens
    scale = float(gram.diagonal()[fit.kept].mean())
    if tokens < len(fit.columns):
        unknowns = len(fit.columns)
        why = f"the fit has {unknowns} unknowns per output and the calibration data gave {tokens} tokens"
        return fit.fallback(f"{why}; give at least {unknowns} tokens")
    if not scale > 0:
        return fit.fallback("the kept heads' outputs carry no energy on the calibration tokens")
    ridges = RIDGES if fit.heldout else (RIDGE_WITHOUT_HOLDOUT,)
    best = min(_ridge_fits(fit, gram, scale, ridges), key=lambda f: f[0], default=None)
    if best is None or not math.isfinite(best[0]):
        return fit.fallback("the least-squares system gave values that are not finite in the weights' dtype")
    error, ridge, theta = best
    return fit.result(theta, ridge, error)


@dataclass(frozen=True)
class _Fit:
    """One layer's refit problem: the unpruned [W, b] (`full`), the fitted columns of [W, 1] (`columns`: the
    kept features, and the bias with `bias`), the ridge's prior for them, the calibration tokens' Gram matrix
    (`gram`), the one that judges a fit (the held-out one when there is one) and its energy, the bias left as
    it is without `bias`, the weights' dtype."""

    full: torch.Tensor
    kept: torch.Tensor
    columns: torch.Tensor
    prior: torch.Tensor
    gram: torch.Tensor
    judge: torch.Tensor
    energy: float
    heldout: bool
    bias: bool
    old_bias: torch.Tensor
    dtype: torch.dtype

    @classmethod
    def of(
        cls,
        layer: AttentionLayer,
        removed: Iterable[int],
        calibration: Moments,
        heldout: Moments | None,
        bias: bool,
        shared: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> _Fit:
        gram = calibration.matrix()
        inner = gram.shape[0] - 1  # the features recorded: the layer's, then any alternatives' (merges)
        full = _extended(_unpruned(layer, gram.device), inner)  # [out, inner + 1]
        kept, gone = kept_and_removed(layer, removed)
        kept, own = shared if shared is not None else (kept, kept)  # recorded features, and each one's own input
        # the prior: each unchanged feature's own column, and a re-pointed one's zero with its mean output moved
        # into the bias, as if it were removed (bias compensation: the limit a re-pointed head is pulled to)
        moved = kept != own
        compensated = torch.cat([gone, own[moved]])
        old_bias = full[:, inner]
        if bias:  # the kept features and the constant 1
            mean = gram[:inner, inner] / max(calibration.tokens, 1)
            columns = torch.cat([kept, torch.tensor([inner])])
            weights = full[:, own].masked_fill(moved[None, :], 0.0)
            prior = torch.cat([weights, (old_bias + full[:, compensated] @ mean[compensated])[:, None]], 1)
        else:  # the bias on both sides of the fit: it cancels
            full = torch.cat([full[:, :inner], full.new_zeros(full.shape[0], 1)], 1)
            columns, prior = kept, full[:, own].masked_fill(moved[None, :], 0.0)
        held = heldout is not None and heldout.tokens > 0
        judge = heldout.matrix() if heldout is not None and held else gram
        dtype = output_projection(layer).module.weight.dtype
        return cls(full, kept, columns, prior, gram, judge, _energy(full, judge), held, bias, old_bias, dtype)

    def error(self, theta: torch.Tensor) -> float:
        """The fit `theta`'s squared error relative to the unpruned output's energy, on the judging tokens."""
        return _squared_error(theta, self.full, self.columns, self.judge) / self.energy

    def result(self, theta: torch.Tensor, ridge: float, error: float, fallback: str | None = None) -> Refit:
        """The fit `theta` as written into the weights (their dtype: half the bytes), in CPU memory."""
        weight = (theta[:, :-1] if self.bias else theta).to("cpu", self.dtype)
        return Refit(weight, (theta[:, -1] if self.bias else self.old_bias).cpu(), ridge, error, fallback)

    def fallback(self, why: str) -> Refit:
        """The ridge's prior (bias compensation) in place of a fit that cannot be trusted, saying `why`."""
        return self.result(self.prior, math.inf, self.error(self.prior), why)


def _ridge_fits(
    fit: _Fit, gram: torch.Tensor, scale: float, ridges: Iterable[float]
) -> Iterator[tuple[float, float, torch.Tensor]]:
    """(relative error, ridge, fit) at each ridge (infinite: the prior) whose damped system is positive definite
    and whose values are finite in the weights' dtype, on the statistics' device: only the fit kept goes to CPU
    memory. Each ridge solves theta (G_kk + d I) = [W, b] G[:, k] + d prior by its own Cholesky factorization:
    fewer operations in all than one eigendecomposition shared by the ridges, and faster ones (blocked, as
    matrix products are)."""
    kept = gram[fit.columns][:, fit.columns]
    target = fit.full @ gram[:, fit.columns]  # [W, b] G[:, k]
    for ridge in ridges:
        theta = fit.prior if math.isinf(ridge) else _damped_solve(kept, target, fit.prior, ridge * scale)
        if theta is not None and torch.isfinite(theta).all() and torch.isfinite(theta.to(fit.dtype)).all():
            yield fit.error(theta), ridge, theta


def _damped_solve(kept: torch.Tensor, target: torch.Tensor, prior: torch.Tensor, damping: float) -> torch.Tensor | None:
    """theta = (target + damping prior) (kept + damping I)^-1, or None where that matrix is not positive
    definite (the statistics' rounding outweighs the damping, or they overflowed): that ridge is not tried."""
    damped = kept.clone()
    damped.diagonal().add_(damping)
    factor, info = torch.linalg.cholesky_ex(damped)
    if info:
        return None
    return torch.cholesky_solve((target + damping * prior).T, factor).T


def refit_flops(layers: list[AttentionLayer], plan: dict[str, list[int]]) -> float:
    """The counted work of the plan's reconstruction (`_fit_flops` per pruned layer)."""
    total = 0.0
    for layer in layers:
        if plan.get(layer.name):
            kept = (layer.num_heads - len(plan[layer.name])) * layer.head_dim
            total += _fit_flops(layer, layer.num_heads * layer.head_dim, kept)
    return total


def shared_refit_flops(layers: list[AttentionLayer], sharing: Mapping[str, Mapping[int, int]]) -> float:
    """The counted work of the refits of the layers that `sharing` merges KV heads in, each fitting every query
    head's features among its own inputs and its re-pointed heads' (`_fit_flops`)."""
    total = 0.0
    for layer in layers:
        if sharing.get(layer.name):
            moved = sum(1 for h in layer.heads if layer.kv_of(h) in sharing[layer.name])
            width = layer.num_heads * layer.head_dim
            total += _fit_flops(layer, width + moved * layer.head_dim, width)
    return total


def _fit_flops(layer: AttentionLayer, recorded: int, kept: int) -> float:
    """One refit's counted work, `recorded` input features and `kept` of them fitted: the right-hand side (2 out w
    m, m = kept + 1, w = recorded + 1), per finite ridge a Cholesky factorization (m^3 / 3) and its two
    triangular solves (2 out m^2), and per ridge the fit's error (2 out w^2)."""
    out, w, m = output_projection(layer).features("out"), recorded + 1, kept + 1
    finite = sum(1 for ridge in RIDGES if math.isfinite(ridge))
    return 2 * out * w * m + finite * (m**3 / 3 + 2 * out * m * m) + len(RIDGES) * 2 * out * w * w


class RemovalCost:
    """Structured OBS: `cost(layer name, removed heads)` is the increase of the squared error of the layer's
    output when those heads go and the output projection's other columns and bias are refitted, tr(W_R
    ((H^-1)_RR)^-1 W_R^T) with H the Gram matrix of [x, 1] (damped by DAMPING), relative to the unpruned output's
    energy so that layers compare. Inverses are made one layer at a time, as selection asks, on the device the
    statistics came from; both are Cholesky factorizations (H is positive definite once damped), a tenth of
    an eigendecomposition's work. `flops` counts the work of the costs asked so far: per layer its inverse
    (4/3 n^3 for n features), per cost the removed block's factor (g^3 / 3) and solve (out g^2)."""

    def __init__(self, layers: list[AttentionLayer], moments: list[Moments]) -> None:
        self.by_name = {layer.name: (layer, m) for layer, m in zip(layers, moments)}
        self.cached: tuple[str, torch.Tensor, torch.Tensor, float] | None = None
        self.flops = 0.0

    def __call__(self, name: str, removed: tuple[int, ...]) -> float:
        full, inverted, energy = self._inverse(name)
        _, gone = kept_and_removed(self.by_name[name][0], removed)
        self.flops += len(gone) ** 3 / 3 + full.shape[0] * len(gone) ** 2
        solved = _whitened(inverted[gone][:, gone], full[:, gone].T)
        return float((solved * solved).sum()) / energy

    def _inverse(self, name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Layer `name`'s unpruned [W, b], its damped Gram matrix's inverse and its output's energy (the last
        layer's kept)."""
        if self.cached is None or self.cached[0] != name:
            layer, m = self.by_name[name]
            gram = m.matrix()
            full = _unpruned(layer, gram.device)
            inner = full.shape[1] - 1
            damped = gram.clone()
            damped.diagonal()[:inner] += DAMPING * float(gram.diagonal()[:inner].mean())
            self.cached = (name, full, _spd_inverse(damped), _energy(full, gram))
            self.flops += 4 / 3 * gram.shape[0] ** 3
        return self.cached[1:]


def _spd_inverse(matrix: torch.Tensor) -> torch.Tensor:
    """The inverse of a symmetric positive definite matrix from its Cholesky factor (the pseudo-inverse where
    rounding leaves it not quite positive definite)."""
    factor, info = torch.linalg.cholesky_ex(matrix)
    return torch.cholesky_inverse(factor) if not info else torch.linalg.pinv(matrix, hermitian=True)


def _whitened(matrix: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """L^-1 `right` for `matrix` = L L^T (symmetric positive definite), so that |L^-1 B|^2 = tr(B^T M^-1 B); the
    pseudo-inverse's square root where rounding leaves it not quite positive definite."""
    factor, info = torch.linalg.cholesky_ex(matrix)
    if not info:
        return torch.linalg.solve_triangular(factor, right, upper=False)
    values, vectors = torch.linalg.eigh(matrix)
    keep = values > values.max() * matrix.shape[0] * torch.finfo(matrix.dtype).eps
    return (vectors[:, keep] / values[keep].sqrt()).T @ right


@torch.no_grad()
def reconstruct(
    model: nn.Module, reference: nn.Module, dataloader: Iterable[dict], bias: bool = True, holdout: float = 0.2
) -> dict[str, dict[str, Any]]:
    """Refit every pruned layer of `model` (a pruned copy of the unpruned `reference`) in place, as the
    default path does (`refit`): the output projection's kept columns and, with `bias` where the layer has
    one, its bias, by ridge least squares to the unpruned layer's output, from the Gram matrices of the
    reference's output-projection inputs over the calibration batches, the ridge chosen on the `holdout`
    of them. Returns per pruned layer the ridge chosen (inf: bias compensation), the relative squared error
    and, where the fit fell back to bias compensation, why."""
    device = input_device(reference)
    batches = [to_device(without_labels(b), device) for b in dataloader]
    calib, held = split_holdout(batches, holdout)
    objective = Objective(reference)
    calibration = record(reference, calib, objective, gram=True)
    heldout = record(reference, held, objective, gram=True) if held else None
    pruned = {layer.name: layer for layer in find_attention(model)}
    report: dict[str, dict[str, Any]] = {}
    for i, unpruned in enumerate(find_attention(reference)):
        layer = pruned.get(unpruned.name)
        if layer is None or layer.heads == unpruned.heads:
            continue
        projection = output_projection(layer)
        removed = [h for h in unpruned.heads if h not in layer.heads]
        held_moments = heldout.moments[i] if heldout is not None else None
        has_bias = bias and projection.module.bias is not None
        fitted = refit(unpruned, removed, calibration.moments[i], held_moments, has_bias)
        projection.matrix().copy_(fitted.weight)
        if projection.module.bias is not None:
            projection.module.bias.copy_(fitted.bias.to(projection.module.bias.dtype))
        report[layer.name] = {"ridge": fitted.ridge, "relative_error": fitted.error, "fallback": fitted.fallback}
    return report
