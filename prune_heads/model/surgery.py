"""Physical head removal: slice the projections, update the attributes, record what was removed.

Copied as it is into standalone checkpoints (see standalone.py): it may import only torch, transformers,
families and layers (the modules before it there).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DynamicLayer, EncoderDecoderCache

from ..errors import PruneHeadsError
from .layers import (
    AttentionLayer,
    Projection,
    describe,
    find_attention,
    kv_head_of,
    qkv_parts,
    resolve,
    shared_order,
)

Plan = Mapping[int, Iterable[int]] | Mapping[str, Iterable[int]] | Mapping[int | str, Iterable[int]]
RECORD_KEY = "prune_heads"


class PlanError(PruneHeadsError, ValueError):
    """Raised for a head plan that cannot be applied; the message says what is possible."""


class RecordError(PruneHeadsError, ValueError):
    """Raised when a saved `config.prune_heads` record does not describe the model it is loaded into."""


class ConfigView:
    """A per-module view of a shared model config: reads fall through, writes stay on the view."""

    def __init__(self, base) -> None:
        self.__dict__["_base"] = base

    def __getattr__(self, name: str):
        if name == "_base":
            raise AttributeError(name)
        return getattr(self._base, name)


class HeadlessLayer(DynamicLayer):
    """The cache of a layer without heads: its keys and values hold no numbers ([batch, 0, tokens, head_dim]), so
    its length is their shape, where DynamicLayer reports 0 for any empty tensor. Without it a model whose first
    layer lost every head would tell `generate` that nothing is cached (transformers reads layer 0's length)."""

    def get_seq_length(self) -> int:
        return self.keys.shape[-2] if self.is_initialized and self.keys is not None else 0


_CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")  # by transformers version and family


def self_cache(args: tuple, kwargs: dict) -> Cache | None:
    """The self-attention cache an attention module was called with, under any of its names, else None."""
    cache = next((kwargs[n] for n in _CACHE_NAMES if kwargs.get(n) is not None), None)
    cache = cache if cache is not None else next((a for a in args if isinstance(a, Cache)), None)
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


def mark_headless(cache: Cache, layer_idx: int) -> None:
    """Let a layer's cache count its tokens although it holds no heads (see HeadlessLayer)."""
    layers = getattr(cache, "layers", ())
    if layer_idx < len(layers) and type(layers[layer_idx]) is DynamicLayer:
        layers[layer_idx].__class__ = HeadlessLayer


def _headless_after_forward(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
    """A forward hook for an emptied layer that runs its own attention code: its cache counts its tokens."""
    cache = self_cache(args, kwargs)
    if cache is not None and getattr(module, "layer_idx", None) is not None:
        mark_headless(cache, module.layer_idx)


class NoHeads:
    """Forward of an attention module that lost every head: no attention, only the output projection's bias.

    A self-attention layer still appends zero-head keys and values to the cache, so the cache keeps
    counting tokens for this layer.
    """

    def __init__(
        self, project: nn.Module | None, outputs: int, head_dim: int, layer_idx: int | None, cross: bool
    ) -> None:
        self.project: Any = project  # the output projection, whose bias the layer still adds (or None)
        self.outputs, self.head_dim = outputs, head_dim
        self.layer_idx, self.cross = layer_idx, cross

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> tuple:
        context = hidden_states.new_zeros(*hidden_states.shape[:-1], 0)
        cache = self_cache(args, kwargs)
        if cache is not None and not self.cross and self.layer_idx is not None:
            empty = hidden_states.new_zeros(hidden_states.shape[0], 0, hidden_states.shape[1], self.head_dim)
            cache.update(empty, empty, self.layer_idx)
            mark_headless(cache, self.layer_idx)
        if self.project is None:
            return (context,) + (None,) * (self.outputs - 1)
        width = Projection(self.project).features("out")
        output = hidden_states.new_zeros(*hidden_states.shape[:-1], width)
        if self.project.bias is not None:
            output = output + self.project.bias
        return (output,) + (None,) * (self.outputs - 1)


def normalize_plan(layers: list[AttentionLayer], plan: Plan) -> dict[str, list[int]]:
    """Turn `{layer index or name: [original heads]}` into `{layer name: sorted heads}`, checking every entry.

    Raises PlanError for an unknown layer, a head outside the layer, a head already removed, or a
    grouped-query plan that leaves kept KV groups with different numbers of query heads.
    """
    normalized: dict[str, list[int]] = {}
    for key, heads in plan.items():
        layer = layer_for(layers, key)
        heads = sorted(set(normalized.get(layer.name, [])) | {int(h) for h in heads})
        if heads and any(p.device.type == "meta" for p in layer.module.parameters()):
            raise PlanError(
                f"{layer.name} is offloaded (device_map put its weights on disk or CPU offload); prune it with "
                f"ph.prune_model, or call prune_heads.model.onload.onload_offloaded(model) first"
            )
        for h in heads:
            if not 0 <= h < layer.original_num_heads:
                raise PlanError(f"{layer.name} has heads 0..{layer.original_num_heads - 1}; head {h} does not exist")
            if h not in layer.heads:
                raise PlanError(f"head {h} of {layer.name} was already removed; heads left: {list(layer.heads)}")
        check_groups(layer, [h for h in layer.heads if h not in heads], dict(layer.merges))
        if heads:
            normalized[layer.name] = heads
    return normalized


def layer_for(layers: list[AttentionLayer], key: int | str) -> AttentionLayer:
    """The layer a plan's key names (its index in `layers`, as an int or digits, or its module name); PlanError
    naming what exists otherwise."""
    by_name = {layer.name: layer for layer in layers}
    if isinstance(key, str) and key.isdigit() and key not in by_name:
        key = int(key)
    if isinstance(key, int):
        if not 0 <= key < len(layers):
            raise PlanError(f"layer {key} does not exist: the model has attention layers 0..{len(layers) - 1}")
        return layers[key]
    if key in by_name:
        return by_name[key]
    raise PlanError(f"no attention layer named {key!r}; prune_heads.find_attention(model) lists them")


def check_groups(layer: AttentionLayer, kept: list[int], merges: dict[int, int]) -> None:
    """PlanError unless every KV head left serves as many of the `kept` query heads as the others (once
    `merges` apply), as a grouped-query layer needs."""
    counts: dict[int, int] = {}
    for h in kept:
        kv = kv_head_of(h, layer.group_size, merges)
        counts[kv] = counts.get(kv, 0) + 1
    if len(set(counts.values())) > 1:
        raise PlanError(
            f"{layer.name} uses grouped-query attention ({layer.group_size} query heads per KV head): every kept "
            f"KV group must keep the same number of query heads, but this plan keeps {counts} (group: heads); "
            f"remove whole groups or the same number of heads from each group"
        )


def head_features(positions: list[int], head_dim: int, device: torch.device) -> torch.Tensor:
    """Feature indices [len(positions) * head_dim] of the heads at these positions of a projection."""
    positions_t = torch.tensor(positions, dtype=torch.long, device=device)
    return (positions_t[:, None] * head_dim + torch.arange(head_dim, device=device)).reshape(-1)


def _set_attribute(module: nn.Module, path: str, attribute: str, value: int) -> None:
    target = resolve(module, path)
    if isinstance(target, PretrainedConfig):
        parent_path, _, last = path.rpartition(".")
        target = ConfigView(target)
        setattr(resolve(module, parent_path), last, target)
    setattr(target, attribute, value)


def _keep_heads_at(module: nn.Module, path: str, positions: list[int], dim: int | None) -> None:
    """Keep the entries of the heads at `positions` in the parameter (along `dim`) or ModuleList (`dim`
    None) at `path`, where the module has one; an embedding's width follows its columns."""
    parent_path, _, name = path.rpartition(".")
    try:
        parent = resolve(module, parent_path)
        value = getattr(parent, name)
    except AttributeError:
        return
    if dim is None:
        setattr(parent, name, nn.ModuleList([value[p] for p in positions]))
        return
    index = torch.tensor(positions, dtype=torch.long, device=value.device)
    setattr(parent, name, nn.Parameter(value.index_select(dim, index), value.requires_grad))
    if dim == 1 and hasattr(parent, "embedding_dim"):
        parent.embedding_dim = len(positions)


def remove_heads(layer: AttentionLayer, heads: Iterable[int]) -> AttentionLayer:
    """Remove the given ORIGINAL heads of one layer in place and return its new snapshot.

    KV heads whose query heads are all gone are removed with them. The weights keep their dtype, device
    and requires_grad. Callers validate the plan first (see normalize_plan).
    """
    return relayout(layer, heads, {})


@torch.no_grad()
def relayout(layer: AttentionLayer, removed: Iterable[int], merges: Mapping[int, int]) -> AttentionLayer:
    """Remove the ORIGINAL query heads `removed` of one layer in place, let the query heads of each KV head
    merged into another (`merges`, on top of the layer's own) attend to that one, and return the new snapshot.

    The query heads are laid out by the KV head they attend to (`shared_order`), their output-projection
    columns with them; a KV head left without query heads, or merged, loses its key and value rows. What the
    re-pointed heads' queries need to read their new keys is folded in before (`prune_heads.model.kv_sharing`).
    Callers validate first (see normalize_plan and `check_groups`).
    """
    spec, dim = layer.spec, layer.head_dim
    module: Any = layer.module  # its own attributes are updated and recorded
    merged = {**dict(layer.merges), **merges}
    gone = set(removed)
    kept = list(shared_order(tuple(h for h in layer.heads if h not in gone), layer.group_size, merged))
    kept_kv = sorted({kv_head_of(h, layer.group_size, merged) for h in kept})
    q_pos = [layer.heads.index(h) for h in kept]
    kv_pos = [layer.kv_heads.index(g) for g in kept_kv]
    o_proj = Projection(resolve(module, spec.o))
    _slice_projections(layer, q_pos, kv_pos)
    q_index = head_features(q_pos, dim, o_proj.module.weight.device)
    for path in spec.per_head_out:
        with contextlib.suppress(AttributeError):  # a family's optional projection this module has not
            Projection(resolve(module, path)).keep(q_index, "out")
    for paths, axis, positions in (
        (spec.per_head_columns, 1, q_pos),
        (spec.per_head_params, 0, q_pos),
        (spec.per_head_lists, None, q_pos),
        (spec.per_kv_head_lists, None, kv_pos),
    ):
        for path in paths:
            _keep_heads_at(module, path, positions, axis)
    o_proj.keep(q_index, "in")
    quantities = {
        "heads": len(kept),
        "kv_heads": len(kept_kv),
        "inner": len(kept) * dim,
        "kv_groups": len(kept) // len(kept_kv) if kept_kv else 1,
    }
    for path, attribute, quantity in spec.updates:
        _set_attribute(module, path, attribute, quantities[quantity])
    if not kept:
        _without_heads(layer, o_proj)
    module._ph_record = {
        **getattr(module, "_ph_record", {}),
        "num_heads": layer.original_num_heads,
        "num_kv_heads": layer.original_num_kv_heads,
        "removed": sorted(set(range(layer.original_num_heads)) - set(kept)),
        **({"shared": {str(j): g for j, g in sorted(merged.items())}} if merged else {}),
    }
    module._ph_present = kept
    return describe(module, spec, layer.name, layer.index)


def _slice_projections(layer: AttentionLayer, q_pos: list[int], kv_pos: list[int]) -> None:
    """Keep the query rows of the kept heads and the key / value rows of the kept KV heads, in one index per
    projection (a fused one holds q, k and v) and in the projection's own order."""
    parts, _ = qkv_parts(layer.module, layer.spec, layer.num_heads, layer.head_dim)
    slices: dict[int, tuple[Projection, list[torch.Tensor]]] = {}
    for name, slot in parts.items():
        index = slot.features(q_pos if name == "q" else kv_pos, layer.head_dim)
        slices.setdefault(id(slot.projection.module), (slot.projection, []))[1].append(index)
    for projection, indices in slices.values():  # a fused projection keeps its own order; one alone, the heads'
        projection.keep(torch.cat(indices).sort().values if len(indices) > 1 else indices[0], "out")


def _without_heads(layer: AttentionLayer, o_proj: Projection) -> None:
    """A layer with no head left: its family's stand-in forward (`NoHeads`) where the spec names one, else a
    hook after the attention's own forward (`_headless_after_forward`)."""
    spec, module = layer.spec, cast(Any, layer.module)
    if spec.no_heads is not None:
        owner = resolve(module, spec.no_heads)
        projects = spec.no_heads == "" or spec.o.startswith(spec.no_heads + ".")
        owner.forward = NoHeads(
            o_proj.module if projects else None,
            spec.no_heads_outputs,
            layer.head_dim,
            getattr(module, "layer_idx", None),
            layer.kind == "cross",
        )
    elif layer.kind == "self" and not getattr(module, "_ph_headless_hook", False):
        module.register_forward_hook(_headless_after_forward, with_kwargs=True)
        module._ph_headless_hook = True


def prepare(model: nn.Module, layers: list[AttentionLayer], plan: Mapping[str, Any]) -> None:
    """Run the one-time preparation of every family in the plan (idempotent; outputs do not change)."""
    by_name = {layer.name: layer for layer in layers}
    for spec in {by_name[name].spec for name in plan}:
        if spec.prepare is not None:
            spec.prepare(model)


def apply_plan(model: nn.Module, layers: list[AttentionLayer], plan: dict[str, list[int]]) -> None:
    """Run each family's one-time preparation, then remove the planned heads layer by layer."""
    prepare(model, layers, plan)
    by_name = {layer.name: layer for layer in layers}
    for name, heads in plan.items():
        remove_heads(by_name[name], heads)


def write_record(model: nn.Module, layers: list[AttentionLayer]) -> None:
    """Store every layer's record (original head counts, removed heads, added bias) in `model.config`."""
    config = getattr(model, "config", None)
    record = {layer.name: layer.module._ph_record for layer in layers if hasattr(layer.module, "_ph_record")}
    if config is not None and record:
        setattr(config, RECORD_KEY, {"format": 1, "layers": record, "digest": record_digest(record)})


def record_digest(layers: Mapping[str, Any]) -> str:
    """A short hash of a record's layers, saved with it so that a hand-edited record is caught on load (an
    edit that keeps the shapes, removed [2, 3] for [0, 1], would otherwise relabel the heads silently)."""
    return hashlib.sha256(json.dumps(layers, sort_keys=True).encode()).hexdigest()[:16]


def _zero_bias(o_proj: Any) -> None:
    weight = o_proj.weight
    o_proj.bias = nn.Parameter(weight.new_zeros(Projection(o_proj).features("out")), requires_grad=weight.requires_grad)


def _record_bias(layer: AttentionLayer, default: dict) -> None:
    """Record that the layer's output projection has a bias prune-heads created, so `load_pruned` creates it."""
    module: Any = layer.module
    module._ph_record = {**(getattr(module, "_ph_record", None) or default), "bias": True}


@torch.no_grad()
def add_output_bias(model: nn.Module, biases: Mapping[str, torch.Tensor]) -> None:
    """Add `biases[layer name]` to each layer's attention output projection, creating the bias (and recording
    it, so `load_pruned` re-creates it) where the projection has none."""
    layers = find_attention(model)
    for layer in layers:
        if layer.name not in biases:
            continue
        o_proj = resolve(layer.module, layer.spec.o)
        if o_proj.bias is None:
            _zero_bias(o_proj)
            default = {
                "num_heads": layer.original_num_heads,
                "num_kv_heads": layer.original_num_kv_heads,
                "removed": [],
            }
            _record_bias(layer, default)
        o_proj.bias.add_(biases[layer.name].to(o_proj.bias.device, o_proj.bias.dtype))
    write_record(model, layers)


def _record_plan(layers: list[AttentionLayer], record: Any) -> dict[str, tuple[list[int], dict[int, int]]]:
    """Check a record against a freshly built model and return per layer its removed heads and merged KV heads;
    RecordError names what is wrong."""
    fix = "restore the config.json that save_pruned wrote"
    if not isinstance(record, dict) or record.get("format") != 1 or not isinstance(record.get("layers"), dict):
        raise RecordError(
            f"config.{RECORD_KEY} is not a prune_heads record of format 1 (a dict with 'format': 1 and 'layers'); {fix}"
        )
    by_name = {layer.name: layer for layer in layers}
    plan: dict[str, tuple[list[int], dict[int, int]]] = {}
    for name, entry in record["layers"].items():
        where = f"config.{RECORD_KEY} layer {name!r}"
        layer = by_name.get(name)
        if layer is None:
            raise RecordError(f"{where}: this model has no such attention layer; {fix}")
        if not isinstance(entry, dict) or not isinstance(entry.get("removed"), list):
            raise RecordError(f"{where}: no 'removed' list of heads; {fix}")
        removed = entry["removed"]
        if entry.get("num_heads") != layer.num_heads:
            raise RecordError(
                f"{where}: records num_heads {entry.get('num_heads')!r}, the model builds {layer.num_heads}; {fix}"
            )
        if entry.get("num_kv_heads", layer.num_kv_heads) != layer.num_kv_heads:
            raise RecordError(
                f"{where}: records num_kv_heads {entry['num_kv_heads']!r}, the model builds {layer.num_kv_heads}; {fix}"
            )
        bad = [h for h in removed if type(h) is not int or not 0 <= h < layer.num_heads]
        if bad:
            raise RecordError(f"{where}: removed head(s) {bad} are not heads 0..{layer.num_heads - 1}; {fix}")
        if len(set(removed)) != len(removed):
            raise RecordError(f"{where}: removed lists a head twice ({removed}); {fix}")
        merges = _recorded_merges(layer, entry.get("shared", {}), where, fix)
        try:
            check_groups(layer, [h for h in layer.heads if h not in removed], merges)
        except PlanError:
            raise RecordError(
                f"{where}: removing {removed} leaves KV groups of different sizes, which no pruned "
                f"grouped-query layer has; {fix}"
            ) from None
        if removed or merges:
            plan[name] = (sorted(removed), merges)
    digest = record.get("digest")
    if digest is not None and digest != record_digest(record["layers"]):
        raise RecordError(
            f"config.{RECORD_KEY} was edited after saving (its digest does not match its layers), "
            f"so the head labels cannot be trusted; {fix}"
        )
    return plan


def _recorded_merges(layer: AttentionLayer, shared: Any, where: str, fix: str) -> dict[int, int]:
    """A record's merged KV heads of one layer ({merged: the KV head its query heads attend to}), checked."""
    kv = range(layer.num_kv_heads)
    if not isinstance(shared, dict) or not all(
        isinstance(j, str) and j.isdigit() and int(j) in kv and type(g) is int and g in kv for j, g in shared.items()
    ):
        raise RecordError(f"{where}: 'shared' must map KV heads 0..{layer.num_kv_heads - 1} to KV heads; {fix}")
    merges = {int(j): g for j, g in shared.items()}
    if any(j == g or g in merges for j, g in merges.items()):
        raise RecordError(f"{where}: 'shared' {shared} merges a KV head into itself or into a merged one; {fix}")
    if merges and (layer.spec.fused_qkv or layer.spec.q_blocks > 1 or not layer.spec.grouped):
        raise RecordError(f"{where}: 'shared' on a layer whose family cannot share KV heads; {fix}")
    return merges


def reapply_record(model: nn.Module, record: dict | None) -> None:
    """Re-apply a `config.prune_heads` record to a freshly built (unpruned) model.

    The record is checked first: every layer exists with the recorded head counts, every removed head is an
    integer in range and listed once, grouped-query layers keep whole groups, and the digest saved with it
    matches (a hand edit is refused). Raises RecordError naming the layer and what is wrong.
    """
    if not record:
        return
    layers = find_attention(model)
    plan = _record_plan(layers, record)
    prepare(model, layers, plan)
    by_name = {layer.name: layer for layer in layers}
    for name, (removed, merges) in plan.items():
        relayout(by_name[name], removed, merges)
    for name, entry in record["layers"].items():
        if entry.get("bias"):
            layer = by_name[name]
            o_proj = resolve(layer.module, layer.spec.o)
            if o_proj.bias is None:
                _zero_bias(o_proj)
            _record_bias(layer, entry)
