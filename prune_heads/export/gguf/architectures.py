"""The GGUF architectures: which llama.cpp architecture each Hugging Face model type is written as, and the
metadata it needs from the config (the tensor types written are the config's `GGUF_TYPES` and `FILE_TYPES`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn

from ...errors import PruneHeadsError
from ...model.layers import find_attention

RECORD_FIELD = "prune_heads.record"


DIGEST_FIELD = "prune_heads.source_sha256"


class GgufError(PruneHeadsError, ValueError):
    """A model, plan, tokenizer or output that no GGUF file can hold; the message says what to change."""


FROM_SOURCE = "give the GGUF file the model came from (source=, --gguf-file)"


FROM_WEIGHTS_ROPE = ("default", "linear", "llama3")  # the rope scalings written from Hugging Face weights


def _llama_config(config: Any, head_dim: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The rope metadata (keys after the architecture's name) and tensors of a Llama-like file written from
    Hugging Face weights: the base, and a linear scaling's factor or Llama 3's per-frequency divisors
    (rope_freqs). GgufError for another scaling."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    if kind not in FROM_WEIGHTS_ROPE:
        raise GgufError(f"rope scaling {kind!r} is not written from Hugging Face weights; {FROM_SOURCE}")
    fields: dict[str, Any] = {"rope.freq_base": float(rope.get("rope_theta", getattr(config, "rope_theta", 1e4)))}
    if kind == "linear":
        fields.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(rope["factor"])})
    tensors = {"rope_freqs.weight": _llama3_factors(rope, head_dim)} if kind == "llama3" else {}
    return fields, tensors


def _gemma3_config(config: Any, head_dim: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The metadata of a Gemma 3 file written from Hugging Face weights, where llama.cpp's gemma3 fixes the
    rest (read from its loader): every sixth layer global, the others sliding-window with rope base 10,000
    unscaled, the attention scale 1 / sqrt(head size), GELU (tanh) feed-forwards. A config that differs is
    refused (GgufError), since the file would compute another function."""
    layers = config.num_hidden_layers
    rope = dict(getattr(config, "rope_parameters", None) or {})
    local, full = rope.get("sliding_attention", {}), rope.get("full_attention", {})
    differs = {
        "layer types": list(config.layer_types)
        != ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        "sliding layers' rope": (local.get("rope_type", "default"), local.get("rope_theta")) != ("default", 1e4),
        "global layers' rope": full.get("rope_type", "default") not in ("default", "linear"),
        "query_pre_attn_scalar": config.query_pre_attn_scalar != head_dim,
        "attn_logit_softcapping": bool(config.attn_logit_softcapping),
        "use_bidirectional_attention": bool(getattr(config, "use_bidirectional_attention", False)),
        "hidden_activation": config.hidden_activation != "gelu_pytorch_tanh",
    }
    if any(differs.values()):
        raise GgufError(
            f"gemma3 with its {', '.join(k for k, v in differs.items() if v)} unlike llama.cpp's gemma3 (every sixth "
            f"layer global, sliding layers' rope base 10,000, scale 1/sqrt(head size)) is not written from weights; "
            f"{FROM_SOURCE} or save safetensors"
        )
    fields: dict[str, Any] = {
        "rope.freq_base": float(full.get("rope_theta", 1e6)),
        "attention.sliding_window": int(config.sliding_window),
    }
    if full.get("rope_type") == "linear":
        fields.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(full["factor"])})
    if config.final_logit_softcapping:
        fields["final_logit_softcapping"] = float(config.final_logit_softcapping)
    return fields, {}


@dataclass(frozen=True)
class GgufArch:
    """How one Hugging Face model type is written, read from llama.cpp's loaders. `source` is the architecture
    of a GGUF file of this type, and `source_interleaved` whether its q/k rows are in llama.cpp's interleaved
    rope order. A plan that leaves every layer the same heads is written as `even`, an uneven one as `uneven`
    (None: the type's llama.cpp architecture takes one head count for all layers, so uneven plans are
    refused). `interleaved`: the written architecture's rope pairs neighbouring values, so q/k rows are
    interleaved per head as llama.cpp's converter does. `names`: gguf-py's tensor-name table. `output_bias`:
    whether the written architecture loads an attention output bias (what recovery adds). `norm_shift`: what
    the converter adds to every RMS norm weight. `spec`: the attention family the mapping is for. `fused`: the
    family keeps q, k, v in one tensor (attn_qkv) and the FFN's gate and up in one (ffn_up, gate first), which
    are split into the written architecture's own tensors. `rope_types`: the rope scalings the written
    architecture computes (None: any the source file carries; from weights, `from_config` says).
    `from_config`: the metadata (keys after the architecture's name) and tensors a file written from Hugging
    Face weights takes from the config, GgufError for a config the written architecture cannot compute.
    `dropped`: source metadata keys (after the architecture) the written architecture must not read."""

    source: str
    source_interleaved: bool
    even: str = "llama"
    uneven: str | None = "deci"
    interleaved: bool = True
    names: str = "LLAMA"
    output_bias: bool = True
    norm_shift: float = 0.0  # added to RMS norm weights (Gemma's norms scale by 1 + w; llama.cpp's by w)
    # the metadata and tensors a file written from Hugging Face weights takes from the config (see _llama_config)
    from_config: Callable[[Any, int], tuple[dict[str, Any], dict[str, np.ndarray]]] = _llama_config
    # block counts at which llama.cpp takes the attention scale from n_embd / heads, which pruning would change
    scale_from_heads: tuple[int, ...] = ()
    spec: str = "llama"
    fused: bool = False
    rope_types: tuple[str, ...] | None = None
    dropped: tuple[str, ...] = ()


_QWEN3 = GgufArch(
    "qwen3", source_interleaved=False, even="qwen3", uneven=None, interleaved=False, names="QWEN3", output_bias=False
)


ARCHITECTURES: dict[str, GgufArch] = {  # Hugging Face model_type -> its GGUF files
    "llama": GgufArch("llama", source_interleaved=True),
    "mistral": GgufArch("llama", source_interleaved=True),
    # Llama with q/k/v biases and rotate-half rope; llama.cpp's qwen2 wants attn_q of n_embd x n_embd, so no
    # pruned Qwen2 fits it, while llama and deci take the biases
    "qwen2": GgufArch("qwen2", source_interleaved=False),
    # per-head q/k RMS norms (one weight of head_dim shared by the heads) and rotate-half rope: only llama.cpp's
    # qwen3 computes them, with one head count for every layer and no attention output bias
    "qwen3": _QWEN3,
    # the same per-head q/k norms, norms that scale by 1 + w, sliding-window layers set by the source's metadata
    "gemma3_text": dataclasses.replace(
        _QWEN3,
        source="gemma3",
        even="gemma3",
        names="GEMMA3",
        norm_shift=1.0,
        from_config=_gemma3_config,
        scale_from_heads=(62,),  # llama.cpp's Gemma 3 27B: 1 / sqrt(n_embd / n_head)
    ),
    # llama.cpp's phi3 creates q and the output projection n_embd wide, so no pruned Phi-3 loads as phi3: it
    # goes out as llama / deci with its fused tensors split and its rotate-half q/k rows interleaved. Neither
    # computes Phi-3's long-context rope factors; llama.cpp's phi3 ignores the sliding window, so do these.
    "phi3": GgufArch(
        "phi3",
        source_interleaved=False,
        names="PHI3",
        spec="phi3",
        fused=True,
        rope_types=("default",),
        dropped=("attention.sliding_window",),
    ),
}


UNEVEN = "deci"  # llama.cpp's architecture for layer-wise pruned Llamas: per-layer head counts


def _model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def _arch_of(model: nn.Module) -> GgufArch:
    model_type = _model_type(model)
    arch = ARCHITECTURES.get(model_type) if model_type else None
    layers = find_attention(model)
    if arch is None or any(l.spec.name != arch.spec or l.kind != "self" for l in layers):
        known = ", ".join(sorted(ARCHITECTURES))
        raise GgufError(
            f"no GGUF mapping for {model_type} ({type(model).__name__}): GGUF output covers {known}; "
            f"save safetensors instead (--output-format safetensors)"
        )
    if getattr(model.config, "use_sliding_window", False):
        raise GgufError(
            f"{model_type} with sliding-window attention has no GGUF mapping; save safetensors instead "
            f"(--output-format safetensors)"
        )
    return arch


def _rope(config: Any) -> tuple[str, float]:
    """The model's rope scaling type and the share of each head's width it rotates."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rotated = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return rope.get("rope_type", "default"), float(1.0 if rotated is None else rotated)


def _llama3_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Llama 3's per-frequency rope divisors (what llama.cpp reads from rope_freqs.weight)."""
    theta = float(rope.get("rope_theta", 10000.0))
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < old / high:
            factors.append(1.0)
        elif wavelength > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)
