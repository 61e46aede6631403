"""What one pass over the data adds up per attention layer for `analyze`: each head's contributions through the
output projection (their Gram matrix over tokens), its attention's behaviour, and under grouped-query attention
the KV heads' keys and values (their products over tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...model.hooks import Hook
from ...model.kv_sharing import head_slots, maps_keys
from ...model.layers import AttentionLayer, Projection, resolve
from ...scoring.recording import token_rows

BEHAVIOURS = ("entropy", "distance", "first", "previous", "same")
CHUNK = 512  # token rows whose per-head contributions are held at once


@dataclass
class LayerSums:
    """Running sums of one layer over the pass (float64 on the CPU), filled by the hooks of `layer_hooks`."""

    layer: AttentionLayer
    gram: torch.Tensor
    behaviour: torch.Tensor  # [BEHAVIOURS, heads], summed over `queries` query tokens
    queries: int = 0
    tokens: int = 0  # the token rows the Gram matrix is summed over
    keys: torch.Tensor | None = None  # [kv, kv, head_dim / 2] complex: sums of z_i conj(z_j) per rotary pair
    values: torch.Tensor | None = None  # [kv * head_dim, kv * head_dim]: the values' Gram matrix
    fisher: list[torch.Tensor] = field(default_factory=list)  # per batch, the sum of (dL/dgate)^2 per head

    @classmethod
    def of(cls, layer: AttentionLayer) -> LayerSums:
        heads, grouped = layer.num_heads, layer.group_size > 1 and len(layer.kv_heads) > 1
        width = len(layer.kv_heads) * layer.head_dim
        return cls(
            layer=layer,
            gram=torch.zeros(heads, heads, dtype=torch.float64),
            behaviour=torch.zeros(len(BEHAVIOURS), heads, dtype=torch.float64),
            keys=_key_sums(layer) if grouped and maps_keys(layer) else None,
            values=torch.zeros(width, width, dtype=torch.float64) if grouped else None,
        )


def _key_sums(layer: AttentionLayer) -> torch.Tensor:
    kv = len(layer.kv_heads)
    return torch.zeros(kv, kv, layer.head_dim // 2, dtype=torch.complex128)


def add_contributions(sums: LayerSums, x: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Add the Gram matrix over tokens of what each head writes: its features x through its columns of the
    output projection."""
    layer = sums.layer
    weight = Projection(resolve(layer.module, layer.spec.o)).matrix().detach().float()
    per_head = weight.reshape(weight.shape[0], layer.num_heads, layer.head_dim)  # [out, heads, dim]
    rows = token_rows(x.detach().float(), mask).reshape(-1, layer.num_heads, layer.head_dim)
    sums.tokens += rows.shape[0]
    for start in range(0, rows.shape[0], CHUNK):
        written = torch.einsum("thd,ohd->tho", rows[start : start + CHUNK].to(weight.device), per_head)
        sums.gram += torch.einsum("tho,tgo->hg", written, written).double().cpu()


def add_behaviour(sums: LayerSums, weights: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Add each head's attention entropy, distance and shares on the first, previous and same token over the
    query tokens of attention weights [batch, heads, queries, keys] (self-attention only; a query's own row at
    the sequence's first token, where a causal head has no choice, left out)."""
    batch, _, length, keys = weights.shape
    if keys != length:
        return
    w = weights.detach().float()
    mask = torch.ones(batch, length, device=w.device) if mask is None else mask.to(w.device).float()
    first = mask.argmax(-1)  # the first attended position of each row (left padding before it)
    positions = torch.arange(length, device=w.device)
    valid = mask * (positions[None] > first[:, None])  # [batch, queries]
    gap = (positions[:, None] - positions[None]).abs().float()
    shifted = torch.zeros_like(w[..., 0])
    shifted[..., 1:] = torch.diagonal(w, offset=-1, dim1=-2, dim2=-1)
    index = first[:, None, None, None].expand(batch, w.shape[1], length, 1)
    values = [
        -(w * w.clamp_min(1e-12).log()).sum(-1),
        (w * gap).sum(-1),
        w.gather(-1, index).squeeze(-1),
        shifted,
        torch.diagonal(w, dim1=-2, dim2=-1),
    ]  # each [batch, heads, queries]
    sums.behaviour += torch.stack([(v * valid[:, None]).sum((0, 2)) for v in values]).double().cpu()
    sums.queries += int(valid.sum())


def add_kv(sums: LayerSums, name: str, out: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Add the KV heads' key products per rotary pair, or the values' Gram matrix, from a k or v projection's
    output (its KV heads' features picked out of a fused projection)."""
    layer = sums.layer
    slot = head_slots(layer)[name]
    rows = slot.features(list(range(len(layer.kv_heads))), layer.head_dim).to(out.device)
    tokens = token_rows(out.detach().double()[..., rows], mask).cpu()
    if name == "v" and sums.values is not None:
        sums.values += tokens.T @ tokens
        return
    if sums.keys is None:
        return
    keys = tokens.reshape(-1, len(layer.kv_heads), layer.head_dim)
    half = layer.head_dim // 2
    z = torch.complex(keys[..., :half], keys[..., half:])  # [tokens, kv, pairs], before the rotary embedding
    sums.keys += torch.einsum("tjp,tgp->jgp", z, z.conj())


def layer_hooks(sums: LayerSums, mask: list[torch.Tensor | None]) -> list[Hook]:
    """The hooks that fill `sums` during a forward pass whose attention mask is `mask[0]`."""
    layer = sums.layer

    def contributions(module: nn.Module, args: tuple) -> None:
        add_contributions(sums, args[0], mask[0])

    def behaviour(module: nn.Module, args: tuple, out) -> None:
        weights = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        if torch.is_tensor(weights) and weights.dim() == 4 and weights.shape[1] == layer.num_heads:
            add_behaviour(sums, weights, mask[0])

    found: list[Hook] = [
        (resolve(layer.module, layer.spec.o), "forward_pre", contributions),
        (layer.module, "forward", behaviour),
    ]
    slots = head_slots(layer)
    for name, wanted in (("k", sums.keys), ("v", sums.values)):
        if wanted is not None:
            found.append((slots[name].projection.module, "forward", _kv_hook(sums, name, mask)))
    return found


def _kv_hook(sums: LayerSums, name: str, mask: list[torch.Tensor | None]):
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        add_kv(sums, name, out, mask[0])

    return hook
