"""Shared KV heads: the query heads of a KV head merged into another attend to that one's keys and values, so
the KV cache loses the merged head while every query head stays (the layout stays an ordinary grouped-query
one, which llama.cpp and transformers run).

Keys go through the rotary embedding, which turns each pair (i, i + head_dim / 2) of a key into a complex
number multiplied by a rotation. A complex scale per pair commutes with it, so a merged head's keys are read
as a scale of the kept head's (`fit_key_maps`, least squares over calibration tokens), and that scale's
conjugate is folded into the re-pointed heads' query rows: their logits then use the kept head's keys as they
used the scaled ones. Values carry no rotation; the merged heads read the kept head's, and a refit of the
output projection makes up for the difference.

What is measured runs as hooks (`shared_kv`: the merged heads' keys and values replaced by the kept heads'
mapped ones, on the unchanged model), and `share_kv_heads` proves on copies of the layers that the folded,
re-laid-out layer computes exactly that before it changes the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .families import ROTATE_HALF
from .hooks import Hook, hooks
from .layers import AttentionLayer, HeadSlot, describe, find_attention, qkv_parts
from .probe import capture_calls, first_tensor, float32_copy, mismatch, reason
from .surgery import PlanError, check_groups, layer_for, relayout, write_record

Merges = dict[int, int]  # merged KV head -> the KV head its query heads attend to since (original indices)
KeyMaps = dict[int, torch.Tensor]  # merged KV head -> its keys' complex scale per rotary pair [head_dim // 2]

SHARED = "shared_kv_heads"  # a plan file's key for its sharing, beside each layer's removed heads
_HEAD_NORMS = ("q_norm", "k_norm")  # a scale folded into the query rows does not pass through these


def maps_keys(layer: AttentionLayer) -> bool:
    """Whether the layer's re-pointed keys can be mapped: a rotate-half rotary embedding and no norm of each
    head's queries or keys (elsewhere the merged heads read the kept head's keys as they are)."""
    children = {name for name, _ in layer.module.named_children()}
    return type(layer.module).__name__ in ROTATE_HALF and not children.intersection(_HEAD_NORMS)


def why_not_shared(layer: AttentionLayer) -> str | None:
    """Why the layer's KV heads cannot be shared (None: they can)."""
    if not layer.spec.grouped or layer.original_num_kv_heads == layer.original_num_heads == 1:
        return f"its family ({layer.spec.name}) keeps no grouped-query layout"
    if layer.spec.fused_qkv or layer.spec.q_blocks > 1:
        return "its queries, keys and values share one projection, whose query rows cannot be re-ordered alone"
    if len(layer.kv_heads) < 2:
        return "it has one KV head left"
    return None


def normalize_sharing(
    layers: list[AttentionLayer], sharing: Mapping[int | str, Mapping[int, int]]
) -> dict[str, Merges]:
    """`{layer index or name: {merged KV head: kept KV head}}` as `{layer name: merges}`, checked: PlanError for
    a layer that cannot share, a KV head it does not have, a merge into a merged head, or kept KV heads that
    would serve different numbers of query heads (naming the KV-head counts the layer can reach)."""
    normalized: dict[str, Merges] = {}
    for key, merges in sharing.items():
        layer = layer_for(layers, key)
        merges = {int(j): int(g) for j, g in merges.items()}
        if not merges:
            continue
        why = why_not_shared(layer)
        if why is not None:
            raise PlanError(f"{layer.name} cannot share KV heads: {why}; remove KV groups there instead")
        bad = [kv for kv in (*merges, *merges.values()) if kv not in layer.kv_heads]
        if bad or any(j == g or g in merges for j, g in merges.items()):
            raise PlanError(
                f"{layer.name} has KV heads {list(layer.kv_heads)}: merge each into one that stays (not {merges})"
            )
        try:
            check_groups(layer, list(layer.heads), {**dict(layer.merges), **merges})
        except PlanError:
            counts = [n for n in range(1, len(layer.kv_heads)) if len(layer.kv_heads) % n == 0]
            raise PlanError(
                f"{layer.name}: merging {merges} leaves KV heads serving different numbers of query heads; its "
                f"{len(layer.heads)} query heads over {len(layer.kv_heads)} KV heads can share {counts} KV heads, "
                f"each kept one taking as many merged ones"
            ) from None
        normalized[layer.name] = merges
    return normalized


def split_plan(plan: Mapping[Any, Any]) -> tuple[dict, dict]:
    """A plan as a file holds it, `{layer: [heads removed]}` with `{layer: {merged KV head: kept KV head}}` under
    "shared_kv_heads", as its removals and its sharing (`written_plan` writes it)."""
    return {k: v for k, v in plan.items() if k != SHARED}, dict(plan.get(SHARED) or {})


def written_plan(plan: Mapping[str, list[int]], sharing: Mapping[str, Merges]) -> dict:
    """`plan` with the KV heads it shares, as a plan file holds them (`split_plan` reads it back)."""
    return {**plan, SHARED: {name: dict(merges) for name, merges in sharing.items()}} if sharing else dict(plan)


def rotated(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] with each rotary pair (i, i + head_dim / 2), read as a complex number, multiplied by
    `scale[i]` (complex [head_dim // 2])."""
    half = x.shape[-1] // 2
    real, imag = scale.real.to(x.dtype), scale.imag.to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([real * first - imag * second, imag * first + real * second], dim=-1)


def head_slots(layer: AttentionLayer) -> dict[str, HeadSlot]:
    """Where the layer's q, k and v heads live (`qkv_parts`)."""
    return qkv_parts(layer.module, layer.spec, layer.num_heads, layer.head_dim)[0]


def _replacing(slot: HeadSlot, layer: AttentionLayer, merges: Merges, maps: KeyMaps | None) -> Hook:
    """A forward hook on a key or value projection that gives each merged KV head the output of the one it
    merges into (keys mapped by `maps`)."""
    pairs = [
        (layer.kv_heads.index(j), layer.kv_heads.index(g), None if maps is None else maps.get(j))
        for j, g in merges.items()
    ]

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        replaced = out.clone()  # read from `out`: a head merged into may itself be replaced
        for j, g, scale in pairs:
            source = out[..., slot.features([g], layer.head_dim)]
            replaced[..., slot.features([j], layer.head_dim)] = source if scale is None else rotated(source, scale)
        return replaced

    return (slot.projection.module, "forward", hook)


@contextmanager
def shared_kv(layers: list[AttentionLayer], sharing: dict[str, Merges], key_maps: dict[str, KeyMaps]) -> Iterator[None]:
    """Run the model as it computes once `sharing` applies, without changing a weight: each merged KV head's
    keys are the kept head's mapped by `key_maps` (none: as they are) and its values are the kept head's."""
    registrations = []
    for layer in layers:
        merges = sharing.get(layer.name)
        if merges:
            slots = head_slots(layer)
            registrations.append(_replacing(slots["k"], layer, merges, key_maps.get(layer.name, {})))
            registrations.append(_replacing(slots["v"], layer, merges, None))
    with hooks(registrations):
        yield


@torch.no_grad()
def fold_key_maps(layer: AttentionLayer, merges: Merges, maps: KeyMaps) -> None:
    """Fold each merged KV head's key map into the query rows (and biases) of the heads re-pointed from it: its
    conjugate per rotary pair, so their logits against the kept head's keys are those against the mapped ones."""
    slot = head_slots(layer)["q"]
    module = slot.projection.module
    for position, head in enumerate(layer.heads):
        scale = maps.get(layer.kv_of(head)) if layer.kv_of(head) in merges else None
        if scale is None:
            continue
        rows = slot.features([position], layer.head_dim)
        weight = slot.projection.matrix()
        weight[rows] = rotated(weight[rows].double().t(), scale.conj()).t().to(weight.dtype)
        if module.bias is not None:
            module.bias[rows] = rotated(module.bias[rows].double(), scale.conj()).to(module.bias.dtype)


def fit_key_maps(products: torch.Tensor, merges: Merges, kv_heads: tuple[int, ...]) -> KeyMaps:
    """Each merged KV head's complex scale per rotary pair, a = sum z_j conj(z_g) / sum |z_g|^2: the least-squares
    map of the kept head's keys z_g onto the merged head's z_j (`products` from
    `prune_heads.recovery.sharing_statistics.key_products`)."""
    maps = {}
    for j, g in merges.items():
        a, b = kv_heads.index(j), kv_heads.index(g)
        maps[j] = products[a, b] / products[b, b].real.clamp_min(torch.finfo(torch.float64).tiny)
    return maps


def _differs(layer: AttentionLayer, merges: Merges, maps: KeyMaps, call: tuple) -> str | None:
    """Why the shared layer does not compute what the hooks do on a copy of the unchanged one (None: it does)."""
    reference, args, kwargs = float32_copy(layer, call)
    copied = layer_of(reference, layer)
    try:
        with torch.no_grad(), shared_kv([copied], {layer.name: merges}, {layer.name: maps}):
            expected = first_tensor(reference(*args, **kwargs))
        shared, args, kwargs = float32_copy(layer, call)
        copied = layer_of(shared, layer)
        fold_key_maps(copied, merges, maps)
        relayout(copied, (), merges)
        with torch.no_grad():
            got = first_tensor(shared(*args, **kwargs))
    except Exception as failure:  # the module's own forward, with the hooks or re-laid out
        return f"it fails once shared ({reason(failure)})"
    return mismatch(expected, got)


def layer_of(module: nn.Module, layer: AttentionLayer) -> AttentionLayer:
    """`layer`'s snapshot for a copy of its module."""
    return describe(module, layer.spec, layer.name, layer.index)


def share_kv_heads(
    model: nn.Module,
    sharing: Mapping[Any, Mapping[int, int]],
    key_maps: Mapping[str, KeyMaps] | None = None,
    inputs: dict | None = None,
) -> nn.Module:
    """Share KV heads in place and return the model: in each layer of `sharing` ({layer index or name:
    {merged KV head: kept KV head}}, original indices), the merged heads' query heads attend to the kept
    head's keys (mapped by `key_maps[layer name][merged head]`, see `fit_key_maps`) and values.

    Each layer is proven on copies first (on `inputs`, else random inputs): folded and re-laid out, it must
    compute what `shared_kv` computes on the unchanged layer. Raises PlanError before anything changes for a
    layer that cannot share, a merge no grouped-query layout has, or a key map where keys cannot be mapped.
    The sharing is recorded in `model.config`, so `save_pruned` / `load_pruned` round-trip it.
    """
    merges, maps = prove_sharing(model, sharing, key_maps, inputs)
    apply_sharing(model, merges, maps)
    return model


def prove_sharing(
    model: nn.Module,
    sharing: Mapping[Any, Mapping[int, int]],
    key_maps: Mapping[str, KeyMaps] | None = None,
    inputs: dict | None = None,
) -> tuple[dict[str, Merges], dict[str, KeyMaps]]:
    """`sharing` and its key maps by layer name, each layer proven on copies as `share_kv_heads` proves it (PlanError
    where one is not exact); the model is not changed."""
    layers = find_attention(model)
    merges = normalize_sharing(layers, sharing)
    maps = {name: dict((key_maps or {}).get(name, {})) for name in merges}
    by_name = {layer.name: layer for layer in layers}
    _prove(model, [by_name[name] for name in merges], merges, maps, inputs)
    return merges, maps


def apply_sharing(model: nn.Module, merges: dict[str, Merges], maps: dict[str, KeyMaps]) -> None:
    """Share the KV heads `prove_sharing` proved: the key maps folded into the re-pointed heads' query rows, each
    layer re-laid out and the sharing recorded."""
    layers = find_attention(model)
    by_name = {layer.name: layer for layer in layers}
    for name, layer_merges in merges.items():
        fold_key_maps(by_name[name], layer_merges, maps[name])
        relayout(by_name[name], (), layer_merges)
    write_record(model, layers)


def _prove(
    model: nn.Module,
    planned: list[AttentionLayer],
    merges: dict[str, Merges],
    maps: dict[str, KeyMaps],
    inputs: dict | None,
) -> None:
    """PlanError for the first layer whose sharing is not exact on a copy, or whose keys are mapped where they
    cannot be."""
    for layer in planned:
        if maps[layer.name] and not maps_keys(layer):
            raise PlanError(
                f"{layer.name} ({type(layer.module).__name__}) cannot have its shared keys mapped (its rotary layout "
                f"or a norm of each head's queries or keys does not commute with a scale); share it without key maps"
            )
    calls, failure = capture_calls(model, planned, inputs)
    for layer in planned:
        why: str | None = failure or "a forward pass did not reach it"
        for call in calls.get(layer.name, []):
            why = _differs(layer, merges[layer.name], maps[layer.name], call)
            if why is not None:
                break
        if why is not None:
            raise PlanError(f"cannot share KV heads of {layer.name}: {why}; nothing was changed")
