"""What the pass's sums say: importance with intervals over resampled batches and the stability of its ranking,
how alike heads and KV heads are, and which pairs are near-duplicates."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .records import Matrix, Pair
from .sums import LayerSums

RESAMPLES = 1000  # bootstrap resamples of the batches
LEVEL = 0.95  # of an importance interval; a rank's range is its 5th to 95th percentile
DUPLICATE = 0.75  # share of one head's output (or KV head's keys and values) the other explains, at least
# (a pair called near-duplicate: one of them, replaced by the other scaled, keeps three quarters of what it wrote)


@dataclass(frozen=True)
class Importance:
    """Per head of the whole model, in layer order: the value per example, its interval, its rank and range."""

    value: np.ndarray
    low: np.ndarray
    high: np.ndarray
    rank: np.ndarray
    rank_low: np.ndarray
    rank_high: np.ndarray
    agreement: float


def _ranks(values: np.ndarray) -> np.ndarray:
    """The place of each value along the last axis, 0 = smallest (ties by position: deterministic)."""
    return np.argsort(np.argsort(values, axis=-1, kind="stable"), axis=-1, kind="stable")


def importance(per_batch: np.ndarray, examples: np.ndarray, seed: int) -> Importance:
    """From each batch's sums of the per-example importance [batches, heads] and its examples [batches]: the
    value per example over all batches, and over `RESAMPLES` resamples of the batches with replacement (seeded)
    its `LEVEL` interval, each head's rank range and the ranking's mean Spearman correlation with the full one.
    Batches, not examples, are resampled: examples within a batch are not independent of each other (one text's
    windows)."""
    value = per_batch.sum(0) / max(examples.sum(), 1)
    rank = _ranks(value)
    counts = np.random.default_rng(seed).multinomial(
        len(per_batch), np.full(len(per_batch), 1 / len(per_batch)), RESAMPLES
    )
    resampled = counts @ per_batch / np.maximum(counts @ examples, 1)[:, None]  # [resamples, heads]
    ranks = _ranks(resampled)
    tail = (1 - LEVEL) / 2
    centred, full = ranks - ranks.mean(1, keepdims=True), rank - rank.mean()
    spread = np.sqrt((centred**2).sum(1) * (full**2).sum())
    agreement = float(np.mean((centred @ full) / np.where(spread > 0, spread, 1))) if len(value) > 1 else 1.0
    return Importance(
        value=value,
        low=np.quantile(resampled, tail, axis=0),
        high=np.quantile(resampled, 1 - tail, axis=0),
        rank=rank,
        rank_low=np.quantile(ranks, 0.05, axis=0, method="lower"),
        rank_high=np.quantile(ranks, 0.95, axis=0, method="higher"),
        agreement=agreement,
    )


def cosines(gram: torch.Tensor) -> Matrix:
    """The cosine of each pair from a Gram matrix (0 where either side wrote nothing)."""
    norms = gram.diagonal().clamp_min(0).sqrt()
    outer = norms[:, None] * norms[None]
    found = torch.where(outer > 0, gram / outer.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    return _matrix(found)


def _matrix(values: torch.Tensor) -> Matrix:
    return tuple(tuple(round(float(x), 6) for x in row) for row in values)


def key_shares(products: torch.Tensor) -> Matrix:
    """[i][j]: the share of KV head i's key energy that KV head j's keys explain with one complex scale per rotary
    pair (least squares; the map sharing folds into the queries), from `LayerSums.keys`."""
    energy = products.diagonal(dim1=0, dim2=1).real.T  # [kv, pairs]
    explained = (products.abs() ** 2 / energy[None].clamp_min(torch.finfo(torch.float64).tiny)).sum(-1)
    return _matrix(explained / energy.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny))


def value_shares(gram: torch.Tensor, kv: int) -> Matrix:
    """[i][j]: the share of KV head i's value energy that a linear map of KV head j's values explains (least
    squares; the map the output projection's refit can take), from the values' Gram matrix."""
    dim = gram.shape[0] // kv
    block = [[gram[a * dim : (a + 1) * dim, b * dim : (b + 1) * dim] for b in range(kv)] for a in range(kv)]
    shares = torch.zeros(kv, kv, dtype=torch.float64)
    for a in range(kv):
        total = block[a][a].trace().clamp_min(torch.finfo(torch.float64).tiny)
        for b in range(kv):
            shares[a, b] = (block[a][b] @ torch.linalg.pinv(block[b][b]) @ block[b][a]).trace() / total
    return _matrix(shares)


def head_pairs(sums: LayerSums, similarity: Matrix) -> list[Pair]:
    """The layer's pairs of heads whose outputs' squared cosine is at least `DUPLICATE`."""
    heads = sums.layer.heads
    return [
        Pair(sums.layer.name, heads[i], heads[j], similarity[i][j], "heads")
        for i in range(len(heads))
        for j in range(i + 1, len(heads))
        if similarity[i][j] ** 2 >= DUPLICATE
    ]


def kv_pairs(sums: LayerSums, keys: Matrix | None, values: Matrix | None) -> list[Pair]:
    """The layer's pairs of KV heads each of which explains at least `DUPLICATE` of the other's keys and values."""
    if keys is None or values is None:
        return []
    kv = sums.layer.kv_heads
    found = []
    for i in range(len(kv)):
        for j in range(i + 1, len(kv)):
            alike = min(keys[i][j], keys[j][i], values[i][j], values[j][i])
            if alike >= DUPLICATE:
                found.append(Pair(sums.layer.name, kv[i], kv[j], alike, "kv"))
    return found
