"""Finding the attention layers of a model and describing their heads.

Copied as it is into standalone checkpoints (see standalone.py): it may import only torch, transformers and
families (the module before it there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .families import FAMILIES, AttentionSpec, spec_for_type

_CROSS_NAME_PARTS = ("encoder_attn", "EncDecAttention", "crossattention", "cross_attn")


class UnsupportedModelError(ValueError):
    """Raised when an attention module cannot be mapped onto a registered family."""


@dataclass(frozen=True)
class AttentionLayer:
    """A snapshot of one attention layer: where it is, which heads it still has, who handles it.

    `heads` and `kv_heads` are ORIGINAL indices (as numbered before any pruning). For grouped-query layers,
    query head h belongs to KV head h // (original heads per KV head).
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

    @property
    def group_size(self) -> int:
        """Query heads per KV head in the original layer (1 for plain multi-head attention)."""
        return self.original_num_heads // self.original_num_kv_heads


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


def _fits(module: nn.Module, spec: AttentionSpec) -> bool:
    names = [spec.fused_qkv] if spec.fused_qkv else [spec.q, spec.k, spec.v]
    return all(_has_path(module, p) for p in [*names, spec.o, spec.head_dim])


class Projection:
    """An nn.Linear or a GPT-2 style Conv1D (which stores its weight [in, out]) behind one interface."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
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


def qkv_parts(module: nn.Module, spec: AttentionSpec, num_heads: int, head_dim: int) -> tuple[dict, int]:
    """Where the q, k and v features live, {"q"|"k"|"v": (Projection, first feature)}, and the number of KV
    heads: three projections, or one fused projection holding [q | k | v]."""
    if spec.fused_qkv:
        fused = Projection(resolve(module, spec.fused_qkv))
        kv_heads = (fused.features("out") // head_dim - num_heads) // 2
        q, kv = num_heads * head_dim, kv_heads * head_dim
        return {"q": (fused, 0), "k": (fused, q), "v": (fused, q + kv)}, kv_heads
    parts = {name: (Projection(resolve(module, getattr(spec, name))), 0) for name in ("q", "k", "v")}
    return parts, parts["k"][0].features("out") // head_dim


def describe(module: nn.Module, spec: AttentionSpec, name: str, index: int) -> AttentionLayer:
    """Read head counts from the weights of one attention module (no config is trusted)."""
    head_dim = int(resolve(module, spec.head_dim))
    num_heads = Projection(resolve(module, spec.o)).features("in") // head_dim
    _, num_kv_heads = qkv_parts(module, spec, num_heads, head_dim)
    record = getattr(module, "_ph_record", None)
    if record is None:
        original, original_kv = num_heads, num_kv_heads
        heads = tuple(range(num_heads))
    else:
        original, original_kv = record["num_heads"], record["num_kv_heads"]
        heads = tuple(h for h in range(original) if h not in set(record["removed"]))
    if original_kv == 0 or original % max(original_kv, 1) or (not spec.grouped and num_kv_heads != num_heads):
        raise UnsupportedModelError(
            f"{name} ({type(module).__name__}): projections do not match the '{spec.name}' layout "
            f"({num_heads} query heads, {num_kv_heads} KV heads); register a family for it with "
            f"prune_heads.register_family(AttentionSpec(...))"
        )
    group = original // original_kv
    kv_heads = tuple(sorted({h // group for h in heads}))
    kind = "cross" if getattr(module, "is_cross_attention", False) or any(p in name for p in _CROSS_NAME_PARTS) \
        else "self"
    return AttentionLayer(name=name, index=index, kind=kind, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, heads=heads, kv_heads=kv_heads, original_num_heads=original,
                          original_num_kv_heads=original_kv, spec=spec, module=module)


def find_attention(model: nn.Module) -> list[AttentionLayer]:
    """List the attention layers of a model in forward (registration) order.

    Modules are matched first by class name against the family table, then structurally: an unregistered
    class whose children fit a registered layout (for example q_proj/k_proj/v_proj/o_proj with a head_dim)
    is handled like that family. A module whose class name says attention and that owns projections but fits
    no layout raises UnsupportedModelError naming it.
    """
    found: list[tuple[str, nn.Module, AttentionSpec]] = []
    taken: list[str] = []
    unmatched: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        spec = spec_for_type(type(module).__name__)
        if spec is None and "attention" in type(module).__name__.lower():
            spec = next((s for s in FAMILIES if _fits(module, s)), None)
            if spec is None:
                unmatched.append((name, module))
                continue
        if spec is not None:
            found.append((name, module, spec))
            taken.append(name)
    for name, module in unmatched:
        inside = any(n.startswith(name + ".") or not name for n, _, _ in found)
        owns_projection = any(isinstance(m, nn.Linear) for m in module.children())
        if owns_projection and not inside:
            raise UnsupportedModelError(
                f"{name} ({type(module).__name__}) is an attention module of no registered family; register "
                f"it with prune_heads.register_family(AttentionSpec(name, ({type(module).__name__!r},), q=..., "
                f"k=..., v=..., o=..., head_dim=...))"
            )
    return [describe(module, spec, name, i) for i, (name, module, spec) in enumerate(found)]


def require_attention(model: nn.Module) -> list[AttentionLayer]:
    """`find_attention(model)`, or UnsupportedModelError when the model has no attention layer at all."""
    layers = find_attention(model)
    if not layers:
        raise UnsupportedModelError(f"no attention layers found in the model ({type(model).__name__})")
    return layers
