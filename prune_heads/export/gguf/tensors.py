"""The tensors of a GGUF file: the pruned model's weights named and laid out as llama.cpp reads them, what a
source file's tensors still hold (copied byte for byte) and what is written anew, in which type."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ...model.layers import AttentionLayer, find_attention
from .architectures import ARCHITECTURES, GgufArch, GgufError


@dataclass
class _Block:
    """One attention layer as a GGUF block: the heads it keeps (original indices) and what it writes."""

    index: int
    layer: AttentionLayer
    heads: int = 0  # head counts written in the metadata
    kv_heads: int = 0


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's rotate-half q/k rows to llama.cpp's interleaved pairs, per head."""
    if not heads:
        return w
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _blocks(model: nn.Module, names) -> list[_Block]:
    blocks = []
    for layer in find_attention(model):
        found = names.get_name(f"{layer.name}.{layer.spec.q or layer.spec.fused_qkv}", try_suffixes=(".weight",))
        index = re.match(r"blk\.(\d+)\.", found or "")
        if index is None:
            raise GgufError(f"no GGUF block for {layer.name}")
        blocks.append(_Block(int(index.group(1)), layer, layer.num_heads, layer.num_kv_heads))
    return sorted(blocks, key=lambda b: b.index)


def _block_of(name: str, blocks: dict[int, _Block]) -> _Block | None:
    """The model's block a GGUF tensor name (blk.N.*) belongs to; None for the others."""
    index = re.match(r"blk\.(\d+)\.", name)
    return blocks.get(int(index.group(1))) if index else None


def _split(name: str, value: Any, heads: int, kv_heads: int, head_dim: int) -> dict[str, Any]:
    """A fused tensor's rows as the separate tensors llama.cpp's llama architecture loads: attn_qkv as attn_q
    (`heads` heads of `head_dim` rows), attn_k and attn_v (`kv_heads` each); ffn_up as ffn_gate (its first
    half) and ffn_up; any other tensor as itself."""
    part = re.fullmatch(r"(blk\.\d+\.)(attn_qkv|ffn_up)\.(weight|bias)", name)
    if part is None:
        return {name: value}
    block, fused, kind = part.groups()
    if fused == "ffn_up":
        half = len(value) // 2
        return {f"{block}ffn_gate.{kind}": value[:half], f"{block}ffn_up.{kind}": value[half:]}
    q, kv = heads * head_dim, kv_heads * head_dim
    rows = {"attn_q": (0, q), "attn_k": (q, q + kv), "attn_v": (q + kv, q + 2 * kv)}
    return {f"{block}{p}.{kind}": value[a:b] for p, (a, b) in rows.items()}


def _targets(model: nn.Module, names, blocks: list[_Block], arch: GgufArch) -> dict[str, np.ndarray]:
    """The model's tensors as GGUF wants them: GGUF names, float32, fused tensors split (`arch.fused`), q/k
    rows interleaved per head (`arch.interleaved`), `arch.norm_shift` added to the norm weights."""
    by_block = {b.index: b for b in blocks}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        found = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if found is None:
            raise GgufError(f"no GGUF name for {name}; GGUF output covers {', '.join(sorted(ARCHITECTURES))}")
        value = tensor.detach().float().cpu().numpy()
        block = _block_of(found, by_block)
        parts = {found: value}
        if arch.fused and block is not None:
            parts = _split(found, value, block.layer.num_heads, block.layer.num_kv_heads, block.layer.head_dim)
        for target, value in parts.items():
            part = re.fullmatch(r"blk\.\d+\.attn_(q|k)\.(weight|bias)", target)
            if part and arch.interleaved and block is not None:
                value = _permute(value, block.layer.num_heads if part.group(1) == "q" else block.layer.num_kv_heads)
            if arch.norm_shift and target.endswith("norm.weight"):
                value = value + np.float32(arch.norm_shift)
            out[target] = value
    return out


@dataclass(frozen=True)
class _Rows:
    """Rows of a source tensor standing as a tensor of their own (a part of a fused tensor)."""

    data: Any
    tensor_type: Any


def _unfused(tensors: dict[str, Any], blocks: dict[int, _Block]) -> dict[str, Any]:
    """The source's tensors with each fused one (attn_qkv, ffn_up) replaced by its parts, in place, by the
    layer's original head counts (the source file is unpruned)."""
    out: dict[str, Any] = {}
    for name, tensor in tensors.items():
        block = _block_of(name, blocks)
        if block is None:
            out[name] = tensor
            continue
        layer = block.layer
        heads, kv_heads = layer.original_num_heads, layer.original_num_kv_heads
        parts = _split(name, np.asarray(tensor.data), heads, kv_heads, layer.head_dim)
        if list(parts) == [name]:
            out[name] = tensor
        else:
            out.update({part: _Rows(rows, tensor.tensor_type) for part, rows in parts.items()})
    return out


def _architecture(blocks: list[_Block], arch: GgufArch, model_type: str | None) -> str:
    """`arch.even` when every layer keeps the same heads, else `arch.uneven` (refused where there is none)."""
    if len({(b.heads, b.kv_heads) for b in blocks}) == 1 and blocks[0].heads:
        return arch.even
    if arch.uneven is None:
        raise GgufError(_UNEVEN_REFUSED.format(model_type=model_type, arch=arch.even))
    return arch.uneven


_UNEVEN_REFUSED = (
    "llama.cpp's {arch} architecture takes one head count for every layer, and this plan leaves layers "
    "different heads; prune {model_type} with --uniform (selection.uniform: true; for GQA: whole KV groups, or "
    "--gqa even for query heads only) or save safetensors"
)


_BIAS_REFUSED = (
    "llama.cpp's {arch} architecture loads no attention output bias, and recovery adds one; prune {model_type} "
    "with --no-bias-compensation --no-bias-tuning (recovery then fits without one) or save safetensors"
)


def _attention_free(targets: dict[str, np.ndarray], blocks: list[_Block], tied: bool) -> None:
    """Layers left without heads, as `deci` holds them. A layer after the first is attention-free (no
    attention tensors, no norm), its constant output (its output bias) added to the previous layer's FFN
    output bias. The first layer must keep a head count for llama.cpp to read the head size, so it becomes
    deci's 'linear attention' with an all-zero output projection (exact: it adds nothing), its bias added
    to the token embeddings (the output layer then gets its own copy of the original embeddings)."""
    for block in blocks:
        if block.heads:
            continue
        i = block.index
        bias = targets.pop(f"blk.{i}.attn_output.bias", None)
        for part in ("q", "k", "v", "output"):
            for kind in ("weight", "bias"):
                targets.pop(f"blk.{i}.attn_{part}.{kind}", None)
        if i > 0:
            targets.pop(f"blk.{i}.attn_norm.weight", None)
            if bias is not None and bias.any():
                down = f"blk.{i - 1}.ffn_down.bias"
                targets[down] = targets.get(down, np.zeros_like(bias)) + bias
            continue
        width = targets["token_embd.weight"].shape[1]
        block.heads, block.kv_heads = 1, 0
        targets["blk.0.attn_output.weight"] = np.zeros((width, width), dtype=np.float32)
        if bias is not None and bias.any():
            if tied:
                targets["output.weight"] = targets["token_embd.weight"].copy()
            targets["token_embd.weight"] = targets["token_embd.weight"] + bias


def _rows(name: str, blocks: dict[int, _Block], interleave: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The (rows, columns) of the source tensor that `name` keeps, in the written order: the kept heads'
    rows of q, k, v and their biases (q/k rows interleaved per head when `interleave`: the source's are in
    rotate-half order), the kept heads' columns of the output projection; None for all."""
    part = re.fullmatch(r"blk\.(\d+)\.attn_(q|k|v|output)\.(weight|bias)", name)
    if part is None or int(part.group(1)) not in blocks:
        return None, None
    layer = blocks[int(part.group(1))].layer
    heads = layer.kv_heads if part.group(2) in ("k", "v") else layer.heads
    within = np.arange(layer.head_dim)
    if interleave and part.group(2) in ("q", "k"):
        within = _permute(within, 1)
    index = np.concatenate([h * layer.head_dim + within for h in heads]) if len(heads) else np.zeros(0, np.int64)
    if part.group(2) == "output":
        return (None, index) if part.group(3) == "weight" else (None, None)
    return index, None


def _candidate(tensor, rows: np.ndarray | None, columns: np.ndarray | None):
    """The source tensor's bytes restricted to `rows` / `columns`, as (raw array, GGML type), or None where
    the columns do not fall on whole quantization blocks."""
    import gguf

    data, qtype = np.asarray(tensor.data), tensor.tensor_type
    if rows is not None:
        data = data[rows]
    if columns is not None:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        if data.dtype != np.uint8:  # plain floats: columns are elements
            data = data[..., columns]
        elif len(columns) and (columns[::block] % block).any() or len(columns) % block:
            return None
        else:
            starts = columns[::block] // block * size
            data = data[:, (starts[:, None] + np.arange(size)).reshape(-1)]
    return np.ascontiguousarray(data), qtype


def _values(raw: np.ndarray, qtype) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(raw, qtype).astype(np.float32, copy=False)


@dataclass(frozen=True)
class Held:
    """How the model holds a source tensor's values: in `dtype` (a bfloat16 model holds them rounded), the
    norms with `shift` added after (as `GgufArch.norm_shift` writes them)."""

    dtype: torch.dtype = torch.float32
    shift: float = 0.0

    def of(self, name: str, values: np.ndarray) -> np.ndarray:
        """The source's `values` of `name` as the model holds them."""
        if self.dtype == torch.float32:
            return values
        shift = np.float32(self.shift if name.endswith("norm.weight") else 0.0)
        return torch.from_numpy(values - shift).to(self.dtype).float().numpy() + shift


def _unchanged(
    name: str, value: np.ndarray | None, tensors: dict, blocks: dict[int, _Block], interleave: bool, held: Held
):
    """The source bytes for `name` (its kept rows or columns) when the model holds exactly their values as
    `value` (always for a tensor the model has no weight for), else None. A missing output.weight stands in as
    the token embeddings it was tied to."""
    tensor = tensors.get(name, tensors.get("token_embd.weight") if name == "output.weight" else None)
    if tensor is None:
        return None
    raw = _candidate(tensor, *_rows(name, blocks, interleave))
    if raw is not None and raw[0].size == 0:  # nothing of the source is kept (deci's zero first projection)
        return None
    if value is None or raw is None:
        return raw
    values = held.of(name, _values(*raw))
    return raw if values.size == value.size and np.array_equal(values.reshape(value.shape), value) else None


_LADDER = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16", "F16", "F32")  # what gguf-py writes, by bits per weight


def _bits(qtype) -> float:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return size * 8 / block


def _encode(value: np.ndarray, wanted: str, source_type=None) -> tuple[np.ndarray, Any]:
    """`value` as (raw array, GGML type) in the type `wanted`; "source": the source tensor's type where gguf-py
    writes it and its blocks fit the rows, else the first type that does with at least as many bits per
    weight (`_LADDER`). 1-D tensors (norms, biases) are F32, as llama.cpp adds them."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if value.ndim == 1:
        return value.astype(np.float32), Q.F32
    if wanted == "source":
        fits = [Q[name] for name in _LADDER if value.shape[-1] % gguf.GGML_QUANT_SIZES[Q[name]][0] == 0]
        need = _bits(source_type) if source_type is not None else 16.0
        qtype = source_type if source_type in fits else next(t for t in fits if _bits(t) >= need)
    else:
        qtype = Q[wanted.upper()]
    if qtype in (Q.F16, Q.F32):
        return value.astype(np.float16 if qtype == Q.F16 else np.float32), qtype
    return gguf.quants.quantize(value, qtype), qtype
