"""Physical head removal: slice the projections, update the attributes, record what was removed.

Copied as it is into standalone checkpoints (see standalone.py): it may import only torch, transformers,
families and layers (the modules before it there).
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import EncoderDecoderCache

from .layers import AttentionLayer, Projection, describe, find_attention, qkv_parts, resolve

Plan = Mapping[int | str, Iterable[int]]
RECORD_KEY = "prune_heads"


class PlanError(ValueError):
    """Raised for a head plan that cannot be applied; the message says what is possible."""


class ConfigView:
    """A per-module view of a shared model config: reads fall through, writes stay on the view."""

    def __init__(self, base) -> None:
        self.__dict__["_base"] = base

    def __getattr__(self, name: str):
        if name == "_base":
            raise AttributeError(name)
        return getattr(self._base, name)


class NoHeads:
    """Forward of an attention module that lost every head: no attention, only the output projection's bias.

    A self-attention layer still appends zero-head keys and values to the cache, so the cache keeps
    counting tokens for this layer.
    """

    def __init__(self, project: nn.Module | None, outputs: int, head_dim: int, layer_idx: int | None,
                 cross: bool) -> None:
        self.project, self.outputs, self.head_dim = project, outputs, head_dim
        self.layer_idx, self.cross = layer_idx, cross

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> tuple:
        context = hidden_states.new_zeros(*hidden_states.shape[:-1], 0)
        cache = kwargs.get("past_key_values")
        if isinstance(cache, EncoderDecoderCache):
            cache = cache.self_attention_cache
        if cache is not None and not self.cross and self.layer_idx is not None:
            empty = hidden_states.new_zeros(hidden_states.shape[0], 0, hidden_states.shape[1], self.head_dim)
            cache.update(empty, empty, self.layer_idx)
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
    by_name = {layer.name: layer for layer in layers}
    normalized: dict[str, list[int]] = {}
    for key, heads in plan.items():
        if isinstance(key, str) and key.isdigit() and key not in by_name:
            key = int(key)
        if isinstance(key, int):
            if not 0 <= key < len(layers):
                raise PlanError(f"layer {key} does not exist: the model has attention layers 0..{len(layers) - 1}")
            layer = layers[key]
        elif key in by_name:
            layer = by_name[key]
        else:
            raise PlanError(f"no attention layer named {key!r}; prune_heads.find_attention(model) lists them")
        heads = sorted(set(normalized.get(layer.name, [])) | {int(h) for h in heads})
        if heads and any(p.device.type == "meta" for p in layer.module.parameters()):
            raise PlanError(f"{layer.name} is offloaded (device_map put its weights on disk or CPU offload); load "
                            f"the model without offloading (device_map=None, or more max_memory) to prune it")
        for h in heads:
            if not 0 <= h < layer.original_num_heads:
                raise PlanError(f"{layer.name} has heads 0..{layer.original_num_heads - 1}; head {h} does not exist")
            if h not in layer.heads:
                raise PlanError(f"head {h} of {layer.name} was already removed; heads left: {list(layer.heads)}")
        _check_groups(layer, [h for h in layer.heads if h not in heads])
        if heads:
            normalized[layer.name] = heads
    return normalized


def _check_groups(layer: AttentionLayer, kept: list[int]) -> None:
    counts: dict[int, int] = {}
    for h in kept:
        counts[h // layer.group_size] = counts.get(h // layer.group_size, 0) + 1
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


@torch.no_grad()
def remove_heads(layer: AttentionLayer, heads: Iterable[int]) -> AttentionLayer:
    """Remove the given ORIGINAL heads of one layer in place and return its new snapshot.

    KV heads whose query heads are all gone are removed with them. The weights keep their dtype, device
    and requires_grad. Callers validate the plan first (see normalize_plan).
    """
    spec, module, dim = layer.spec, layer.module, layer.head_dim
    remove = set(heads)
    kept = [h for h in layer.heads if h not in remove]
    kept_kv = sorted({h // layer.group_size for h in kept})
    q_pos = [layer.heads.index(h) for h in kept]
    kv_pos = [layer.kv_heads.index(g) for g in kept_kv]
    o_proj = Projection(resolve(module, spec.o))
    device = o_proj.module.weight.device
    q_index = head_features(q_pos, dim, device)
    kv_index = head_features(kv_pos, dim, device)
    parts, _ = qkv_parts(module, spec, layer.num_heads, dim)
    slices: dict[int, tuple[Projection, list[torch.Tensor]]] = {}  # one index per projection (fused: q, k, v)
    for name, (projection, first) in parts.items():
        index = (q_index if name == "q" else kv_index) + first
        slices.setdefault(id(projection.module), (projection, []))[1].append(index)
    for projection, indices in slices.values():
        projection.keep(torch.cat(indices), "out")
    for path in spec.per_head_out:
        try:
            Projection(resolve(module, path)).keep(q_index, "out")
        except AttributeError:
            pass
    for path in spec.per_head_columns:
        parent_path, _, name = path.rpartition(".")
        try:
            parent = resolve(module, parent_path)
        except AttributeError:
            continue
        table = getattr(parent, name)
        setattr(parent, name, nn.Parameter(table.index_select(1, torch.tensor(q_pos, dtype=torch.long, device=table.device)),
                                           table.requires_grad))
        if hasattr(parent, "embedding_dim"):
            parent.embedding_dim = len(q_pos)
    o_proj.keep(q_index, "in")
    quantities = {"heads": len(kept), "kv_heads": len(kept_kv), "inner": len(kept) * dim,
                  "kv_groups": len(kept) // len(kept_kv) if kept_kv else 1}
    for path, attribute, quantity in spec.updates:
        _set_attribute(module, path, attribute, quantities[quantity])
    if not kept and spec.no_heads is not None:
        owner = resolve(module, spec.no_heads)
        projects = spec.no_heads == "" or spec.o.startswith(spec.no_heads + ".")
        owner.forward = NoHeads(o_proj.module if projects else None, spec.no_heads_outputs, dim,
                                getattr(module, "layer_idx", None), layer.kind == "cross")
    module._ph_record = {**getattr(module, "_ph_record", {}), "num_heads": layer.original_num_heads,
                         "num_kv_heads": layer.original_num_kv_heads,
                         "removed": sorted(set(range(layer.original_num_heads)) - set(kept))}
    module._ph_present = kept
    return describe(module, spec, layer.name, layer.index)


def apply_plan(model: nn.Module, layers: list[AttentionLayer], plan: dict[str, list[int]]) -> None:
    """Run each family's one-time preparation, then remove the planned heads layer by layer."""
    by_name = {layer.name: layer for layer in layers}
    for spec in {by_name[name].spec for name in plan}:
        if spec.prepare is not None:
            spec.prepare(model)
    for name, heads in plan.items():
        remove_heads(by_name[name], heads)


def _write_record(model: nn.Module, layers: list[AttentionLayer]) -> None:
    """Store every layer's record (original head counts, removed heads, added bias) in `model.config`."""
    config = getattr(model, "config", None)
    record = {layer.name: layer.module._ph_record for layer in layers if hasattr(layer.module, "_ph_record")}
    if config is not None and record:
        setattr(config, RECORD_KEY, {"format": 1, "layers": record})


def prune(model: nn.Module, heads_to_prune: Plan) -> nn.Module:
    """Physically remove attention heads from `model`, in place, and return it.

    `heads_to_prune` maps a layer (index into `find_attention(model)` or its module name) to the ORIGINAL
    indices of the heads to remove, as transformers 4's `prune_heads` took them. Pruning twice accumulates.
    The removed heads are recorded in `model.config` so that `save_pruned` / `load_pruned` round-trip.
    Raises PlanError for a plan that cannot be applied.
    """
    layers = find_attention(model)
    plan = normalize_plan(layers, heads_to_prune)
    apply_plan(model, layers, plan)
    if plan:
        _write_record(model, layers)
    return model


def _zero_bias(o_proj: nn.Module) -> None:
    weight = o_proj.weight
    o_proj.bias = nn.Parameter(weight.new_zeros(Projection(o_proj).features("out")), requires_grad=weight.requires_grad)


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
            record = getattr(layer.module, "_ph_record", None) or {
                "num_heads": layer.original_num_heads, "num_kv_heads": layer.original_num_kv_heads, "removed": []}
            layer.module._ph_record = {**record, "bias": True}
        o_proj.bias.add_(biases[layer.name].to(o_proj.bias.device, o_proj.bias.dtype))
    _write_record(model, layers)


def reapply_record(model: nn.Module, record: dict | None) -> None:
    """Re-apply a `config.prune_heads` record to a freshly built (unpruned) model."""
    if not record:
        return
    if record.get("format") != 1 or not isinstance(record.get("layers"), dict):
        raise ValueError(f"config.{RECORD_KEY} is not a prune_heads record of format 1: {record!r}")
    layers = find_attention(model)
    by_name = {layer.name: layer for layer in layers}
    for name, entry in record["layers"].items():
        layer = by_name.get(name)
        if layer is None or layer.num_heads != entry["num_heads"]:
            raise ValueError(f"config.{RECORD_KEY} names layer {name!r} with {entry['num_heads']} heads, "
                             f"which this model does not have; was the config edited by hand?")
    apply_plan(model, layers, {name: entry["removed"] for name, entry in record["layers"].items()
                               if entry["removed"]})
    for name, entry in record["layers"].items():
        if entry.get("bias"):
            layer = by_name[name]
            o_proj = resolve(layer.module, layer.spec.o)
            if o_proj.bias is None:
                _zero_bias(o_proj)
            layer.module._ph_record = {**getattr(layer.module, "_ph_record", entry), "bias": True}
