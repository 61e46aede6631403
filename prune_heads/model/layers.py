"""Finding the attention layers of a model and describing their heads.

Copied as it is into standalone checkpoints (see standalone.py): it may import only torch, transformers and
families (the module before it there).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import PruneHeadsError
from .families import FAMILIES, NOT_EXACT, AttentionSpec, spec_for_type

logger = logging.getLogger("prune_heads")
_CROSS_NAME_PARTS = ("encoder_attn", "EncDecAttention", "crossattention", "cross_attn")


class UnsupportedModelError(PruneHeadsError, ValueError):
    """Raised when an attention module cannot be mapped onto a registered family."""


@dataclass(frozen=True)
class AttentionLayer:
    """A snapshot of one attention layer: where it is, which heads it still has, who handles it.

    `heads` and `kv_heads` are ORIGINAL indices (as numbered before any pruning), `heads` in the order the
    layer holds them. For grouped-query layers, query head h belongs to KV head h // (original heads per KV
    head), unless that KV head was merged into another: `merges` pairs each merged KV head with the one its
    query heads attend to since (`prune_heads.model.kv_sharing`).
    """

    name: str
    index: int
    kind: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    original_num_heads: int
    original_num_kv_heads: int
    spec: AttentionSpec
    module: nn.Module
    merges: tuple[tuple[int, int], ...] = ()

    @property
    def group_size(self) -> int:
        """Query heads per KV head in the original layer (1 for plain multi-head attention)."""
        return self.original_num_heads // self.original_num_kv_heads

    def kv_of(self, head: int) -> int:
        """The original KV head that query head `head` (an original index) attends to."""
        return kv_head_of(head, self.group_size, dict(self.merges))


def kv_head_of(head: int, group_size: int, merges: dict[int, int]) -> int:
    """The original KV head query head `head` attends to: its own group's, or the one that group was merged into."""
    own = head // group_size
    return merges.get(own, own)


def shared_order(heads: tuple[int, ...], group_size: int, merges: dict[int, int]) -> tuple[int, ...]:
    """The query heads in the order a layer holds them once `merges` apply: by the KV head each attends to, so
    every KV head's query heads are contiguous (as llama.cpp and transformers' repeat_kv read them), and by
    original index within it."""
    return tuple(sorted(heads, key=lambda h: (kv_head_of(h, group_size, merges), h)))


def resolve(module: nn.Module, path: str):
    """Follow a dotted attribute path from a module ("" is the module itself)."""
    for part in filter(None, path.split(".")):
        module = getattr(module, part)
    return module


def _has_path(module: nn.Module, path: str | None) -> bool:
    try:
        return path is not None and resolve(module, path) is not None
    except AttributeError:
        return False


# head counts an unregistered module may keep in its own attributes or its config (quantity, attributes)
_HEAD_COUNTS = (
    ("heads", ("num_heads", "num_attention_heads", "n_heads", "n_head")),
    ("kv_heads", ("num_key_value_heads", "num_kv_heads", "n_kv_heads")),
    ("kv_groups", ("num_key_value_groups",)),
    ("inner", ("embed_dim", "inner_dim", "all_head_size", "d_model_size", "split_size")),
)


def head_dim_of(module: nn.Module, spec: AttentionSpec) -> int:
    """The module's head size: the attribute `spec.head_dim` names, or what the spec's function computes."""
    return int(spec.head_dim(module) if callable(spec.head_dim) else resolve(module, spec.head_dim))


def _structural_spec(module: Any, spec: AttentionSpec) -> AttentionSpec:
    """A structural match's spec, also handling what the module keeps per head under common shapes and names
    (the probe then proves the result): head counts in its attributes or config (`inner` names only where
    they equal heads * head_dim), parameters whose first dimension is the heads (attention sinks, logit
    scales) or whose columns are (relative position bias tables), and further projections with one output
    block per head (output gates). Found once, while the module has its original heads, and kept on it: a
    later head count can coincide with some other size."""
    cached = getattr(module, "_ph_structural_spec", None)
    if cached is not None and cached.name == spec.name:
        return cached
    head_dim = head_dim_of(module, spec)
    heads = Projection(resolve(module, spec.o)).features("in") // max(head_dim, 1)
    taken = {id(resolve(module, p)) for p in (spec.q, spec.k, spec.v, spec.o, spec.fused_qkv) if p is not None}
    gates = tuple(
        name
        for name, child in module.named_children()
        if is_projection(child)
        and id(child) not in taken
        and heads > 1
        and Projection(child).features("out") == heads * head_dim
    )
    projections = [p for p in (spec.q, spec.k, spec.v, spec.o, spec.fused_qkv, *gates) if p is not None]
    own = [
        (name, param)
        for name, param in module.named_parameters()
        if heads > 1 and not any(name.startswith(p + ".") for p in projections)
    ]
    sinks = tuple(name for name, param in own if param.dim() >= 1 and param.shape[0] == heads)
    tables = tuple(name for name, param in own if param.dim() == 2 and param.shape[1] == heads != param.shape[0])
    config = getattr(module, "config", None)
    updates = list(spec.updates)
    for quantity, names in _HEAD_COUNTS:
        for owner, path in ((module, ""), (config, "config")):
            for attribute in names:
                try:
                    value = getattr(owner, attribute, None)
                except Exception:  # configs whose per-layer attributes refuse a global read (Gemma 4)
                    value = None
                if (
                    type(value) is int
                    and (quantity != "inner" or value == heads * head_dim)
                    and (path, attribute, quantity) not in updates
                    and not (path and quantity == "inner")
                ):
                    updates.append((path, attribute, quantity))

    def more(known: tuple[str, ...], found: tuple[str, ...]) -> tuple[str, ...]:
        return known + tuple(f for f in found if f not in known)

    module._ph_structural_spec = dataclasses.replace(
        spec,
        updates=tuple(updates),
        per_head_out=more(spec.per_head_out, gates),
        per_head_params=more(spec.per_head_params, sinks),
        per_head_columns=more(spec.per_head_columns, tables),
    )
    return module._ph_structural_spec


def is_projection(module: object) -> bool:
    """An nn.Linear or a GPT-2 style Conv1D: a module whose weight slicing prunes heads."""
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "weight"))


def _fits(module: nn.Module, spec: AttentionSpec) -> bool:
    names = [spec.fused_qkv] if spec.fused_qkv else [spec.q, spec.k, spec.v]
    if not all(_has_path(module, p) for p in [*names, spec.o]) or not all(
        is_projection(resolve(module, p)) for p in [*names, spec.o]
    ):
        return False
    try:
        return head_dim_of(module, spec) > 0
    except (AttributeError, TypeError, ZeroDivisionError):
        return False


class Projection:
    """An nn.Linear or a GPT-2 style Conv1D (which stores its weight [in, out]) behind one interface."""

    def __init__(self, module: nn.Module) -> None:
        self.module: Any = module  # nn.Linear or Conv1D: weight, bias and their sizes
        self.transposed = not isinstance(module, nn.Linear)

    def features(self, side: str) -> int:
        """Input ("in") or output ("out") features."""
        return self.matrix().shape[0 if side == "out" else 1]

    def matrix(self) -> torch.Tensor:
        """The weight as [out, in] (a view)."""
        return self.module.weight.t() if self.transposed else self.module.weight

    def keep(self, index: torch.Tensor, side: str) -> None:
        """Keep only the `index` output ("out") or input ("in") features, in place (dtype, device and
        requires_grad kept; the bias follows the outputs)."""
        layer, weight = self.module, self.module.weight
        dim = (0 if side == "out" else 1) ^ self.transposed
        layer.weight = nn.Parameter(weight.index_select(dim, index.to(weight.device)), weight.requires_grad)
        if side == "out" and layer.bias is not None:
            layer.bias = nn.Parameter(layer.bias.index_select(0, index.to(layer.bias.device)), layer.bias.requires_grad)
        if self.transposed:
            if side == "out":
                layer.nf = index.numel()
        elif side == "out":
            layer.out_features = index.numel()
        else:
            layer.in_features = index.numel()

    @torch.no_grad()
    def scale_inputs(self, factor: torch.Tensor) -> None:
        """Multiply each input feature's weights by `factor` [in], in place."""
        factor = factor.detach().to(self.module.weight.device, self.module.weight.dtype)
        self.module.weight.mul_(factor[:, None] if self.transposed else factor[None, :])


def output_projection(layer: AttentionLayer) -> Projection:
    """The layer's output projection (the one that consumes the concatenated heads)."""
    return Projection(resolve(layer.module, layer.spec.o))


@dataclass(frozen=True)
class HeadSlot:
    """Where one of q, k, v keeps its heads inside a projection: the heads come in blocks of `per` (one
    block every `stride` features), so head p's features start at (p // per) * stride + (p % per) * head_dim
    + first."""

    projection: Projection
    first: int
    stride: int
    per: int = 1
    blocks: int = 1  # head_dim blocks per head (2: a query and its output gate, Qwen3-Next)

    def features(self, positions: list[int], head_dim: int) -> torch.Tensor:
        """Output-feature indices [len(positions) * blocks * head_dim] of the heads at these positions."""
        device = self.projection.module.weight.device
        p = torch.tensor(positions, dtype=torch.long, device=device)
        width = self.blocks * head_dim
        start = (p // self.per) * self.stride + (p % self.per) * width + self.first
        return (start[:, None] + torch.arange(width, device=device)).reshape(-1)


def qkv_parts(module: nn.Module, spec: AttentionSpec, num_heads: int, head_dim: int) -> tuple[dict[str, HeadSlot], int]:
    """Where the q, k and v heads live, {"q"|"k"|"v": HeadSlot}, and the number of KV heads: three
    projections, or one fused projection laid out as [q | k | v] ("blocks"), [q, k, v] per head ("heads")
    or [q of the group's heads, k, v] per KV group ("groups"); see AttentionSpec.fused_layout."""
    if spec.fused_qkv:
        fused = Projection(resolve(module, spec.fused_qkv))
        kv_heads = (fused.features("out") // head_dim - num_heads) // 2
        layout = spec.fused_layout(module) if callable(spec.fused_layout) else spec.fused_layout
        if layout == "heads":
            return {name: HeadSlot(fused, i * head_dim, 3 * head_dim) for i, name in enumerate("qkv")}, kv_heads
        if layout == "groups":
            per = num_heads // max(kv_heads, 1)
            block = (per + 2) * head_dim
            return {
                "q": HeadSlot(fused, 0, block, per),
                "k": HeadSlot(fused, per * head_dim, block),
                "v": HeadSlot(fused, (per + 1) * head_dim, block),
            }, kv_heads
        q, kv = num_heads * head_dim, kv_heads * head_dim
        return {
            "q": HeadSlot(fused, 0, head_dim),
            "k": HeadSlot(fused, q, head_dim),
            "v": HeadSlot(fused, q + kv, head_dim),
        }, kv_heads
    parts = {name: HeadSlot(Projection(resolve(module, getattr(spec, name))), 0, head_dim) for name in "qkv"}
    if spec.q_blocks > 1:
        parts["q"] = HeadSlot(parts["q"].projection, 0, spec.q_blocks * head_dim, blocks=spec.q_blocks)
    return parts, parts["k"].projection.features("out") // head_dim


def kv_groups_left(layer: AttentionLayer, removed: list[int]) -> int:
    """KV groups `layer` keeps once its query heads `removed` (original indices) go: a group goes with its last
    query head."""
    gone = set(removed)
    return len({layer.kv_of(h) for h in layer.heads if h not in gone})


def head_parameters(layer: AttentionLayer) -> tuple[int, int]:
    """Weights and biases one query head of `layer` holds (its query features and its columns of the output
    projection) and one KV group (its key and value features)."""
    parts, _ = qkv_parts(layer.module, layer.spec, layer.num_heads, layer.head_dim)

    def per_feature(name: str) -> int:
        projection = parts[name].projection
        return projection.features("in") + (projection.module.bias is not None)

    query = parts["q"].blocks * layer.head_dim * per_feature("q")
    return query + layer.head_dim * output_projection(layer).features("out"), layer.head_dim * (
        per_feature("k") + per_feature("v")
    )


def parameters_after(
    model: nn.Module, plan: dict[str, list[int]], sharing: Mapping[str, Mapping[int, int]] | None = None
) -> int:
    """The model's parameters once `plan` (original head indices per layer name) is removed and the KV heads
    `sharing` merges (`{layer name: {merged KV head: kept KV head}}`) are gone."""
    gone = 0
    for layer in require_attention(model):
        removed, merged = plan.get(layer.name, []), len((sharing or {}).get(layer.name, {}))
        query, group = head_parameters(layer)
        gone += len(removed) * query + (layer.num_kv_heads - kv_groups_left(layer, removed) + merged) * group
    return sum(p.numel() for p in model.parameters()) - gone


def sliding_window(layer: AttentionLayer) -> int | None:
    """The tokens `layer` attends back over where it is a sliding-window layer (None where it sees them all)."""
    return getattr(layer.module, "sliding_window", None) or None


def unmeasured_long_range(layers: list[AttentionLayer], plan: dict[str, list[int]], tokens: int) -> str | None:
    """A note where the plan cuts full-attention layers of a model with sliding-window layers while the
    calibration sequences (`tokens` long) fit in the window: there a full-attention layer attends as a sliding
    one does, so what it does beyond the window was never measured (None otherwise)."""
    windows = [w for w in map(sliding_window, layers) if w]
    full = [l.name for l in layers if plan.get(l.name) and not sliding_window(l)]
    if not windows or not full or tokens > min(windows):
        return None
    return (
        f"{len(full)} full-attention layers lose heads ({', '.join(full)}) though the calibration's {tokens}-token "
        f"sequences fit in the sliding window ({min(windows)} tokens): what those layers do beyond it was not "
        "measured; calibrate on longer sequences (--max-length) to measure it, or keep them (selection.ignore)"
    )


def describe(module: nn.Module, spec: AttentionSpec, name: str, index: int) -> AttentionLayer:
    """Read head counts from the weights of one attention module (no config is trusted)."""
    head_dim = head_dim_of(module, spec)
    num_heads = Projection(resolve(module, spec.o)).features("in") // head_dim
    _, num_kv_heads = qkv_parts(module, spec, num_heads, head_dim)
    record = getattr(module, "_ph_record", None)
    merges: dict[int, int] = {}
    if record is None:
        original, original_kv = num_heads, num_kv_heads
        heads = tuple(range(num_heads))
    else:
        original, original_kv = record["num_heads"], record["num_kv_heads"]
        heads = tuple(h for h in range(original) if h not in set(record["removed"]))
        merges = {int(j): int(g) for j, g in record.get("shared", {}).items()}
    if original_kv == 0 or original % max(original_kv, 1) or (not spec.grouped and num_kv_heads != num_heads):
        raise UnsupportedModelError(
            f"{name} ({type(module).__name__}): its projections do not match the '{spec.name}' layout "
            f"({num_heads} query heads, {num_kv_heads} KV heads)"
        )
    group = original // original_kv
    heads = shared_order(heads, group, merges)
    kv_heads = tuple(sorted({kv_head_of(h, group, merges) for h in heads}))
    kind = (
        "cross" if getattr(module, "is_cross_attention", False) or any(p in name for p in _CROSS_NAME_PARTS) else "self"
    )
    return AttentionLayer(
        name=name,
        index=index,
        kind=kind,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        heads=heads,
        kv_heads=kv_heads,
        original_num_heads=original,
        original_num_kv_heads=original_kv,
        spec=spec,
        module=module,
        merges=tuple(sorted(merges.items())),
    )


@dataclass(frozen=True)
class Unsupported:
    """An attention module prune_heads leaves as it is, and why."""

    name: str
    class_name: str
    why: str
    registrable: bool = True  # whether describing it with register_family would let prune_heads handle it


def scan_attention(model: nn.Module) -> tuple[list[AttentionLayer], list[Unsupported]]:
    """The attention layers of a model in forward (registration) order, and the attention modules it cannot
    handle.

    Modules are matched first by class name against the family table, then structurally: an unregistered
    class whose children fit a registered layout (for example q_proj/k_proj/v_proj/o_proj with a head_dim)
    is handled like that family (and proven on a copy before any surgery, see prune_heads.probe). A module
    whose class name says attention and that owns projections but fits no layout, one whose projections do
    not match its family's layout, and a class known not to prune exactly (NOT_EXACT) are unsupported.
    """
    found: list[tuple[str, nn.Module, AttentionSpec]] = []
    unsupported: list[Unsupported] = []
    unmatched: list[tuple[str, nn.Module]] = []
    taken: list[str] = []  # modules found or refused by name: their submodules are not looked at
    for name, module in model.named_modules():
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        cls = type(module).__name__
        if cls in NOT_EXACT:
            unsupported.append(Unsupported(name, cls, f"cannot have heads removed exactly: {NOT_EXACT[cls]}"))
            taken.append(name)
            continue
        spec = spec_for_type(cls)
        if spec is None and "attention" in cls.lower():
            spec = next((s for s in FAMILIES if _fits(module, s)), None)
            if spec is None:
                unmatched.append((name, module))
                continue
            spec = _structural_spec(module, spec)
        if spec is not None:
            found.append((name, module, spec))
            taken.append(name)
    for name, module in unmatched:
        inside = any(n.startswith(name + ".") or not name for n, _, _ in found)
        own = [n for n, p in module.named_parameters(recurse=False) if p.dim() >= 2]
        owns_projection = own or any(_projects(m) for m in module.modules())
        if owns_projection and not inside and not any(name.startswith(u.name + ".") for u in unsupported):
            why = "an attention module of no registered family"
            if own:  # XLNet's relative attention: q, k, v, o and r are parameter tensors [model, heads, head_dim]
                why += f" (its heads live in its own parameter tensors {', '.join(own)}, which no layout describes)"
            unsupported.append(Unsupported(name, type(module).__name__, why))
    tied = _tied(model, {name: module for name, module, _ in found})
    layers: list[AttentionLayer] = []
    for name, module, spec in found:
        if name in tied:
            unsupported.append(Unsupported(name, type(module).__name__, tied[name], registrable=False))
            continue
        try:
            layers.append(describe(module, spec, name, len(layers)))
        except UnsupportedModelError as error:
            unsupported.append(Unsupported(name, type(module).__name__, str(error).split(": ", 1)[-1]))
    return layers, unsupported


def _tied(model: nn.Module, modules: dict[str, nn.Module]) -> dict[str, str]:
    """Why each attention module (by name) whose parameters other modules hold too cannot lose heads: tied
    weights (Zamba's shared transformer block, used at several depths through modules of its own). Removing
    heads replaces a module's parameters, which would untie them (more parameters, and a reload that ties them
    again computes something else). A module object reused at several places is not tied: it is one layer."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for path, owner in model.named_modules(remove_duplicate=False):
        for parameter in owner.parameters(recurse=False):
            owners.setdefault(id(parameter), []).append((path, owner))
    why = {}
    for name, module in modules.items():
        own = {id(m) for m in module.modules()}
        paths = {path for p in module.parameters() for path, o in owners[id(p)] if id(o) not in own}
        # the other attention layers holding them, else the modules themselves
        others = sorted({next((n for n in modules if path.startswith(n + ".")), path) for path in paths})
        if others:
            more = f" and {len(others) - 1} more" if len(others) > 1 else ""
            why[name] = (
                f"its weights are tied to {others[0]}{more}: one set of weights serves several layers, and removing "
                f"heads from one would untie them (prune_heads removes heads from one layer at a time)"
            )
    return why


def _projects(module: nn.Module) -> bool:
    """Whether a module maps features to features: a weight [out, in] (Linear, Conv1D, quantized ones) or a
    pointwise convolution's [out, in, 1, ...] (MobileViTV2's attention projects with 1x1 convolutions)."""
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and not isinstance(module, nn.Embedding)
        and weight.dim() >= 2
        and all(size == 1 for size in weight.shape[2:])
    )


def _supported(layers: list[AttentionLayer], unsupported: list[Unsupported]) -> list[AttentionLayer]:
    """The layers, or UnsupportedModelError when there are attention modules but none prune_heads handles."""
    if unsupported and not layers:
        first = unsupported[0]
        fix = (
            f"; register it with prune_heads.register_family(AttentionSpec(name, ({first.class_name!r},), q=..., "
            f"k=..., v=..., o=..., head_dim=...))"
            if first.registrable
            else "; no attention layer of this model can lose heads"
        )
        raise UnsupportedModelError(f"{first.name} ({first.class_name}): {first.why}{fix}")
    return layers


def find_attention(model: nn.Module) -> list[AttentionLayer]:
    """The attention layers prune_heads can handle, in forward order (see scan_attention).

    Unsupported attention modules beside them are left as they are (`scan_attention` lists them, `inspect`
    shows them, `prune_model` says so in one line). Raises UnsupportedModelError when the model has attention
    modules but none it can handle, naming the first and the `register_family` fix.
    """
    return _supported(*scan_attention(model))


def scan_required(model: nn.Module) -> tuple[list[AttentionLayer], list[Unsupported]]:
    """`scan_attention(model)` in one scan, refused (UnsupportedModelError) when the model has no attention
    layer at all or none that prune_heads handles."""
    layers, unsupported = scan_attention(model)
    if not layers and not unsupported:
        name = getattr(model, "name_or_path", "") or "the model"
        raise UnsupportedModelError(f"no attention layers found in {name} ({type(model).__name__})")
    return _supported(layers, unsupported), unsupported


def require_attention(model: nn.Module) -> list[AttentionLayer]:
    """`find_attention(model)`, saying in one warning which attention modules are left as they are;
    UnsupportedModelError when the model has no attention layer at all."""
    layers, unsupported = scan_required(model)
    name = getattr(model, "name_or_path", "") or "the model"
    if unsupported:
        listed = ", ".join(f"{u.name} ({u.class_name})" for u in unsupported[:3])
        more = f" and {len(unsupported) - 3} more" if len(unsupported) > 3 else ""
        logger.warning(
            "%d attention module(s) of %s are left as they are (%s%s: %s); the other %d layers are "
            "pruned. `prune-heads inspect` lists them",
            len(unsupported),
            name,
            listed,
            more,
            unsupported[0].why,
            len(layers),
        )
    return layers
