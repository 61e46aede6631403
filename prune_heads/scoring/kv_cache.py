"""The KV cache a decoder keeps, and how many heads a KV-cache budget removes (`--kv-cache 120MiB@8192:q8_0`):
the fewest whole KV groups whose removal brings the cache at that context length, in that cache type, within
the size, checked against the model's structure alone, before any data is read."""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from ..config import CACHE_TYPES, KvCacheBudget, size_text
from ..model.layers import AttentionLayer, kv_groups_left, require_attention, sliding_window
from ..model.surgery import PlanError
from .selection import HeadBudget, check_budget


def group_bytes(layer: AttentionLayer, context: int, cache_type: str) -> int:
    """Bytes one KV group of `layer` caches at `context` tokens: a key and a value of the head size per token
    held (a sliding-window layer holds its window), in `cache_type`'s blocks."""
    block, size = CACHE_TYPES[cache_type]
    if not fits_cache([layer], cache_type):
        raise PlanError(
            f"{layer.name}'s head size {layer.head_dim} does not split into {cache_type}'s blocks of {block}; "
            "give another cache type (f16, bf16, f32)"
        )
    window = sliding_window(layer)
    tokens = min(context, window) if window else context
    return 2 * tokens * layer.head_dim // block * size


def fits_cache(layers: list[AttentionLayer], cache_type: str) -> bool:
    """Whether every layer's head size splits into `cache_type`'s blocks (llama.cpp quantizes per head)."""
    return all(l.head_dim % CACHE_TYPES[cache_type][0] == 0 for l in layers)


def kv_cache_size(
    model: nn.Module, context: int, cache_type: str = "f16", plan: dict[str, list[int]] | None = None
) -> int:
    """Bytes of the model's KV cache at `context` tokens in `cache_type` (llama.cpp's names), as it is now or
    once `plan` (original head indices per layer name) is removed."""
    plan = plan or {}
    return sum(
        kv_groups_left(l, plan.get(l.name, [])) * group_bytes(l, context, cache_type) for l in require_attention(model)
    )


def heads_for_kv_cache(model: nn.Module, target: KvCacheBudget, **constraints: Any) -> int:
    """How many more heads to remove, as whole KV groups under `constraints` (HeadBudget's fields besides the
    amount), so the KV cache fits `target`: the fewest that do. Exact where each removed head saves the same
    bytes (equal head sizes and windows) or every layer loses the same (`uniform=True`); otherwise, and where
    the structure cannot go far enough or the cache already fits, PlanError naming the reachable sizes."""
    _check_decoder(model, constraints)
    layers = require_attention(model)
    per_head = _bytes_per_head(layers, target, bool(constraints.get("uniform")))
    now = kv_cache_size(model, target.context, target.cache_type)
    if now <= target.size:
        raise PlanError(
            f"the KV cache is {size_text(now)} at {target.context:,} tokens ({target.cache_type}), already within "
            f"{size_text(target.size)}; ask for less to remove KV groups"
        )
    deepest = check_budget(model, HeadBudget(num_heads=10**9, round="down", **constraints))
    if now - deepest * per_head > target.size:
        raise PlanError(
            f"cannot bring the KV cache within {target}: removing the most the structure allows ({deepest} "
            f"heads as whole KV groups) leaves {size_text(now - deepest * per_head)}; ask for that or more, or lower "
            "min_heads_per_layer"
        )
    needed = math.ceil((now - target.size) / per_head - 1e-9)
    return check_budget(model, HeadBudget(num_heads=needed, round="up", **constraints))


def _bytes_per_head(layers: list[AttentionLayer], target: KvCacheBudget, uniform: bool) -> float:
    """Bytes each removed query head saves (its share of its KV group), the same for every head; with
    `uniform`, the mean over the layers, since every layer then loses the same heads."""
    shares = {l.name: group_bytes(l, target.context, target.cache_type) / l.group_size for l in layers}
    if uniform:
        return sum(shares.values()) / len(shares)
    if len(set(shares.values())) > 1:
        raise PlanError(
            f"this model's KV groups cache different sizes at {target.context:,} tokens (sliding-window layers "
            "or head sizes differ), so the size depends on which groups go; pass uniform=True (--uniform: the same "
            "groups from every layer) or give a number of heads"
        )
    return next(iter(shares.values()))


def _check_decoder(model: nn.Module, constraints: dict[str, Any]) -> None:
    config = getattr(model, "config", None)
    generates = getattr(model, "can_generate", lambda: False)()
    if getattr(config, "is_encoder_decoder", False) or not generates:
        raise PlanError(
            "a KV-cache budget is for decoder-only language models (a causal-LM head that generates); give "
            "sparsity, a number of heads or a FLOPs share"
        )
    if constraints.get("gqa") == "even":
        raise PlanError(
            "gqa='even' removes query heads only and leaves the KV cache as it is; a KV-cache budget removes whole "
            "KV groups (gqa='groups')"
        )
