"""GGUF out: a pruned decoder as one GGUF file for llama.cpp and what is built on it (llama-cpp-python,
ollama, LM Studio).

GGUF in, GGUF out (`source`, found by itself for a model loaded with `gguf_file=`): every tensor of the source
file is copied byte for byte in its own quantization when the model still holds exactly its values; q, k and v
keep their quantization with the removed heads' rows dropped (a head is whole rows, and rows are whole blocks
in every GGML type); the source's metadata (tokenizer, chat template, rope settings) is kept. What changed is
not assumed but checked: each tensor is dequantized and compared with the model's own weights, and whatever
differs (output projections with folded scales, new output biases) is written in `tensor_type`.

Hugging Face in (no source): every tensor in `tensor_type` (f16 by default), the metadata llama.cpp needs
from the config (`GgufArch.from_config`), and the tokenizer's vocabulary so llama.cpp tokenizes text to the
same ids: a byte-level BPE tokenizer as llama.cpp's `gpt2` with the pre-tokenizer whose splitting rules are
its own, a sentencepiece-style one (BPE with byte fallback) as llama.cpp's `llama`, with per-token scores
that make llama.cpp merge in the order of the tokenizer's merges.

Llama, Mistral and Qwen2 (Llama with q/k/v biases) are written as llama.cpp's `llama` when every layer keeps
the same heads, else as its `deci` (per-layer head counts; a layer left without heads is attention-free),
so every plan of theirs is held. Qwen3 and Gemma 3 keep their own architectures (only those compute their
per-head q/k norms), which build every layer with the first layer's head counts and load no attention output
bias: even plans without biases (`ARCHITECTURES` says what each family takes). Read from llama.cpp's loaders:
qwen2 wants q of n_embd x n_embd, and phi3 q and the output projection of n_embd x n_embd, which no pruned
model has.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from ..errors import PruneHeadsError
from ..model.layers import AttentionLayer, find_attention
from ..model.surgery import RECORD_KEY
from .persistence import GGUF_SOURCE_KEY, ensure_file_free, replace_file

_BLOCKED = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")  # gguf-py's quantized types: blocks of 32 values
GGUF_TYPES = ("source", "f32", "f16", "bf16", *_BLOCKED)  # of tensors written anew
# whole-file types of llama.cpp's own quantizer (llama-quantize's names): the file is written, then quantized
FILE_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0", "Q3_K_M", "Q2_K")
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
# llama.cpp's pre-tokenizers, by the splitting of a Hugging Face byte-level BPE tokenizer (tokenizer.json's
# pre_tokenizer): the regular expressions each applies, read from llama.cpp's llama-vocab.cpp
_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
_LLAMA3 = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_QWEN2 = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
PRE_TOKENIZERS: dict[tuple, str] = {
    (("ByteLevel", True),): "gpt-2",
    (("Digits", True), ("ByteLevel", True)): "smollm",
    (("Split", _LLAMA3), ("ByteLevel", False)): "llama-bpe",
    (("Split", _QWEN2), ("ByteLevel", False)): "qwen2",
}


def _signature(pre: dict | None) -> tuple:
    """A tokenizer.json pre_tokenizer as (kind, setting) steps: the regex of a Split, whether a ByteLevel
    splits with GPT-2's own, whether Digits splits single digits."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    out = []
    settings = {
        "Split": lambda s: s.get("pattern", {}).get("Regex"),
        "ByteLevel": lambda s: s.get("use_regex", True),
        "Digits": lambda s: s.get("individual_digits", False),
    }
    for step in steps:
        kind = step.get("type")
        out.append((kind, settings[kind](step) if kind in settings else None))
    return tuple(out)


def _backend(tokenizer: Any) -> dict:
    """A fast tokenizer's tokenizer.json as a dict ({} for a slow one)."""
    return json.loads(tokenizer.backend_tokenizer.to_str()) if getattr(tokenizer, "is_fast", False) else {}


def _byte_level(spec: dict) -> bool:
    model = spec.get("model", {})
    decoder = (spec.get("decoder") or {}).get("type")
    return model.get("type") == "BPE" and not model.get("byte_fallback") and decoder == "ByteLevel"


def _sentencepiece_style(spec: dict) -> bool:
    """BPE with byte fallback whose merges apply as listed (no dropout, no whole-word lookup first)."""
    model = spec.get("model", {})
    listed = not model.get("ignore_merges") and not model.get("dropout")
    return model.get("type") == "BPE" and bool(model.get("byte_fallback")) and listed


def _pre_tokenizer(spec: dict) -> str:
    """The llama.cpp pre-tokenizer that splits text as this byte-level BPE tokenizer does; GgufError when
    llama.cpp has none."""
    name = PRE_TOKENIZERS.get(_signature(spec.get("pre_tokenizer")))
    if name is None:
        raise GgufError(
            f"llama.cpp has no pre-tokenizer known to split text as this tokenizer does "
            f"({_signature(spec.get('pre_tokenizer'))}); {FROM_SOURCE}"
        )
    return name


_SPACES = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
_PREFIX = {"type": "Prepend", "prepend": "\u2581"}
_NO_SPLIT: tuple[dict, ...] = (  # no pre-tokenizer, or Gemma's split at spaces (none are left after _SPACES)
    {},
    {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
)


def _space_prefix(spec: dict) -> bool:
    """Whether llama.cpp's sentencepiece tokenizer (`llama`) must put a space before text to split it as this
    sentencepiece-style tokenizer does; GgufError when it cannot split alike. llama.cpp turns spaces into ▁,
    prefixes one at the start and after every added token where add_space_prefix is set, and splits nothing
    else: the tokenizer must replace spaces by a normalizer, optionally after a Prepend, or by a Metaspace that
    does not split. (A Metaspace prefixes no second ▁ to text that starts with a space, and with
    prepend_scheme "first" none after an added token; llama.cpp, like sentencepiece, does.)"""
    normalizer, pre = spec.get("normalizer"), spec.get("pre_tokenizer") or {}
    steps = normalizer.get("normalizers", []) if normalizer and normalizer.get("type") == "Sequence" else [normalizer]
    if steps in ([_SPACES], [_PREFIX, _SPACES]) and pre in _NO_SPLIT:
        return steps[0] == _PREFIX
    if steps == [None] and pre.get("type") == "Metaspace" and (pre["replacement"], pre["split"]) == ("▁", False):
        return pre["prepend_scheme"] != "never"
    raise GgufError(
        f"llama.cpp's sentencepiece tokenizer cannot split text as this one does (normalizer "
        f"{[s and s.get('type') for s in steps]}, pre-tokenizer {pre.get('type')}: llama.cpp "
        f"replaces spaces, may prefix one and splits nothing); {FROM_SOURCE}"
    )


def _check_merges(tokenizer: Any, spec: dict) -> None:
    """llama.cpp's sentencepiece tokenizer merges, among neighbouring pieces, the pair whose joint text is the
    highest-scoring token, so any split of a token into two others is a merge to it: the tokenizer's merges
    must list every one (those converted from sentencepiece do); GgufError naming the first missing."""
    vocab = _ordinary_tokens(tokenizer, spec)
    merges = {tuple(_pair(m)) for m in spec["model"].get("merges", [])}
    for token in vocab:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab and (left, right) not in merges:
                raise GgufError(
                    f"the tokenizer's merges lack {left!r} + {right!r} (= {token!r}), which llama.cpp's "
                    f"sentencepiece tokenizer would merge; {FROM_SOURCE}"
                )


def _pair(merge: Any) -> list[str]:
    return merge if isinstance(merge, list) else merge.split(" ", 1)


def _ordinary_tokens(tokenizer: Any, spec: dict) -> set[str]:
    """The tokens BPE makes: the vocabulary less the added tokens (which both split off text first)."""
    added = {t.content for t in tokenizer.added_tokens_decoder.values()}
    return {t for t in spec.get("model", {}).get("vocab", {}) if t not in added}


def tokenizer_model(tokenizer: Any) -> str:
    """llama.cpp's tokenizer model for this Hugging Face tokenizer: `gpt2` for byte-level BPE (with the
    pre-tokenizer that splits alike), `llama` for sentencepiece-style BPE (Llama 2, Mistral, Phi-3, Gemma:
    byte fallback, spaces as ▁; `_space_prefix`, `_check_merges`). GgufError, naming --gguf-file, for any
    other kind or one llama.cpp cannot split alike."""
    spec = _backend(tokenizer)
    if _byte_level(spec):
        _pre_tokenizer(spec)
        return "gpt2"
    if _sentencepiece_style(spec):
        _space_prefix(spec)
        _check_merges(tokenizer, spec)
        return "llama"
    raise GgufError(
        f"{type(tokenizer).__name__} is neither byte-level nor sentencepiece-style BPE, the kinds written from "
        f"Hugging Face weights; {FROM_SOURCE}"
    )


@dataclass
class _Block:
    """One attention layer as a GGUF block: the heads it keeps (original indices) and what it writes."""

    index: int
    layer: AttentionLayer
    heads: int = 0  # head counts written in the metadata
    kv_heads: int = 0


@dataclass
class GgufWrite:
    """What `save_gguf` wrote: the file, its architecture, per-layer head counts, the tensors copied byte for
    byte and those written anew (name -> GGML type)."""

    path: Path
    architecture: str
    heads: list[int]
    kv_heads: list[int]
    copied: list[str] = field(default_factory=list)
    written: dict[str, str] = field(default_factory=dict)
    file_type: str | None = None  # the llama.cpp quantizer's type the whole file was quantized to, if any


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


def _source(model: nn.Module, source: str | Path | None) -> Path | None:
    path = source if source is not None else getattr(model.config, GGUF_SOURCE_KEY, None)
    if path is None:
        return None
    if not Path(path).is_file():
        raise GgufError(
            f"the source GGUF file {path} is not there; give the file the model was loaded from "
            f"(source=, --gguf-source), or none to write every tensor from the weights"
        )
    return Path(path)


def _reader(path: Path):
    """The file's parsed header (tokenizer arrays make that take seconds: parsed once per file version)."""
    stat = Path(path).stat()
    return _parsed(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parsed(path: str, size: int, mtime: int):
    import gguf

    return gguf.GGUFReader(path)


def check_gguf(
    model: nn.Module,
    tokenizer: Any = None,
    source: str | Path | None = None,
    tensor_type: str | None = None,
    output: str | Path | None = None,
    overwrite: bool = False,
    uniform: bool | None = None,
    output_biases: bool | None = None,
) -> None:
    """Check before any scoring that the model is writable as GGUF: a mapped family (`ARCHITECTURES`), a
    source file of its architecture or else a config llama.cpp computes alike and a tokenizer it splits
    alike, a valid `tensor_type` whose blocks fit the heads' rows, and a free `output` file. Where the
    family's llama.cpp architecture takes one head count for all layers (Qwen3, Gemma 3), the selection must
    be `uniform`, and where it loads no output bias, recovery must add none (`output_biases` False); None: not
    known yet (the written model is checked again). Raises GgufError (or OutputExistsError)."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise GgufError("GGUF output needs the gguf package: pip install 'prune-heads[gguf]'") from None
    arch = _arch_of(model)
    if tensor_type is not None and tensor_type not in GGUF_TYPES + FILE_TYPES:
        raise GgufError(
            f"tensor type {tensor_type!r} is not one of {', '.join(GGUF_TYPES)} (tensors written anew) or "
            f"{', '.join(FILE_TYPES)} (the whole file, through llama.cpp's quantizer)"
        )
    if tensor_type in FILE_TYPES:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise GgufError(
                f"{tensor_type} quantizes the whole file with llama.cpp's own quantizer: pip install "
                f"'prune-heads[llamacpp]', or give a type of tensors written anew ({', '.join(GGUF_TYPES)})"
            ) from None
    if getattr(model.config, "num_hidden_layers", None) in arch.scale_from_heads:
        raise GgufError(
            f"llama.cpp takes this {_model_type(model)} model's attention scale from its width over its head count, "
            f"so a pruned one would compute another function; save safetensors instead"
        )
    kind, rotated = _rope(model.config)
    if arch.rope_types is not None and (kind not in arch.rope_types or rotated != 1.0):
        raise GgufError(
            f"{_model_type(model)} with {kind} rope over {rotated:g} of each head has no GGUF mapping: llama.cpp's "
            f"{arch.even} computes {', '.join(arch.rope_types)} rope over whole heads; save safetensors instead"
        )
    if arch.uneven is None and uniform is False:
        raise GgufError(_UNEVEN_REFUSED.format(model_type=_model_type(model), arch=arch.even))
    if not arch.output_bias and output_biases:
        raise GgufError(_BIAS_REFUSED.format(model_type=_model_type(model), arch=arch.even))
    if output is not None:
        ensure_file_free(Path(output), overwrite)
    path, layers = _source(model, source), find_attention(model)
    if path is not None:
        found = str(_reader(path).fields["general.architecture"].contents())
        if found != arch.source:
            raise GgufError(
                f"the source {path.name} is a {found} file; a {_model_type(model)} model comes from {arch.source} files"
            )
    elif tokenizer is None:
        raise GgufError("writing GGUF from Hugging Face weights needs the tokenizer (tokenizer=)")
    else:
        arch.from_config(model.config, max(l.head_dim for l in layers))
        tokenizer_model(tokenizer)
    for layer in layers:
        if tensor_type in _BLOCKED and layer.head_dim % 32:
            raise GgufError(
                f"{tensor_type} packs rows in blocks of 32 values; head_dim {layer.head_dim} does not "
                f"split into them: use f16 or f32"
            )


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


def _unchanged(name: str, value: np.ndarray | None, tensors: dict, blocks: dict[int, _Block], interleave: bool):
    """The source bytes for `name` (its kept rows or columns) when they hold exactly `value` (always for a
    tensor the model has no weight for), else None. A missing output.weight stands in as the token
    embeddings it was tied to."""
    tensor = tensors.get(name, tensors.get("token_embd.weight") if name == "output.weight" else None)
    if tensor is None:
        return None
    raw = _candidate(tensor, *_rows(name, blocks, interleave))
    if raw is not None and raw[0].size == 0:  # nothing of the source is kept (deci's zero first projection)
        return None
    if value is None or raw is None:
        return raw
    values = _values(*raw)
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _copy_fields(writer, reader, old: str, new: str, replaced: set[str]) -> None:
    """Every metadata field of the source but the file's own and `replaced`, `old.` keys renamed `new.`."""
    import gguf

    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = new + name[len(old) :] if name.startswith(old + ".") else name
        if key in replaced:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), vtype, sub_type=sub)


def _config_fields(writer, model: nn.Module, tokenizer: Any, targets: dict, head_dim: int, arch: GgufArch) -> None:
    """The metadata of a file written from Hugging Face weights: sizes, what `arch.from_config` takes from the
    config (rope, sliding window; its tensors added to `targets`), and the tokenizer."""
    import gguf

    config: Any = model.config
    writer.add_rope_dimension_count(head_dim)
    writer.add_name(Path(str(getattr(config, "_name_or_path", "") or "model")).name or "model")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(targets["token_embd.weight"].shape[0])
    fields, tensors = arch.from_config(config, head_dim)
    kinds = {str: gguf.GGUFValueType.STRING, int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32}
    for key, value in fields.items():
        writer.add_key_value(f"{writer.arch}.{key}", value, kinds[type(value)])
    targets.update(tensors)
    size = targets["token_embd.weight"].shape[0]
    spec = _backend(tokenizer)
    kind = "gpt2" if _byte_level(spec) else "llama"  # check_gguf checked it (tokenizer_model)
    tokens, types = _vocabulary(tokenizer, size, bytes_as_tokens=kind == "llama")
    writer.add_tokenizer_model(kind)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if kind == "gpt2":
        writer.add_tokenizer_pre(_pre_tokenizer(spec))
    else:
        writer.add_add_space_prefix(_space_prefix(spec))
        writer.add_token_scores(_scores(tokenizer, spec, tokens))
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)  # merges, special ids, add_bos and the chat template, read by gguf
        special = gguf.SpecialVocab(Path(folder), load_merges=kind == "gpt2", n_vocab=size)
        special.add_to_gguf(writer, quiet=True)


def _vocabulary(tokenizer: Any, size: int, bytes_as_tokens: bool) -> tuple[list[str], list[int]]:
    """Every id's token text and GGUF token type: special added tokens are CONTROL (so llama.cpp parses them
    in text, as transformers does), other added ones USER_DEFINED, the unknown token UNKNOWN; with
    `bytes_as_tokens` (sentencepiece style) <0xNN> tokens are BYTE, what llama.cpp falls back to; ids the
    tokenizer lacks, up to the embedding's size, are unused padding."""
    import gguf

    by_id = {i: text for text, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(size):
        text = by_id.get(i)
        tokens.append(f"[PAD{i}]" if text is None else text)
        if text is None:
            types.append(gguf.TokenType.UNUSED)
        elif bytes_as_tokens and i == tokenizer.unk_token_id:
            types.append(gguf.TokenType.UNKNOWN)
        elif i in added:
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        elif bytes_as_tokens and re.fullmatch(r"<0x[0-9A-F]{2}>", text):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _scores(tokenizer: Any, spec: dict, tokens: list[str]) -> list[float]:
    """Scores that make llama.cpp's sentencepiece tokenizer merge in the tokenizer's order: a token made by
    merges scores minus the rank of the first merge that makes it (llama.cpp merges the highest first); the
    others (characters, bytes, added tokens), which no merge of llama.cpp's makes, score 0."""
    ordinary = _ordinary_tokens(tokenizer, spec)
    first: dict[str, int] = {}
    for rank, merge in enumerate(spec["model"]["merges"]):
        first.setdefault("".join(_pair(merge)), rank)
    return [-float(first[t]) if t in first and t in ordinary else 0.0 for t in tokens]


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


def save_gguf(
    model: nn.Module,
    path: str | Path,
    source: str | Path | None = None,
    tokenizer: Any = None,
    tensor_type: str | None = None,
    overwrite: bool = False,
) -> GgufWrite:
    """Write a (pruned) decoder as one GGUF file that llama.cpp loads, and say what was written.

    `source`: the GGUF file the model was loaded from (default: the one `load_pruned(..., gguf_file=)`
    recorded); then every tensor whose values the model still holds is copied byte for byte (q/k/v with the
    removed heads' rows dropped) and the source's metadata kept. Without one, everything is written from the
    weights, with `tokenizer`'s vocabulary. `tensor_type` is the type of what is written anew: "source" (the
    default with a source file: the source tensor's type, or the nearest type gguf-py writes whose blocks
    fit), "f16" (the default without one), "f32", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0". The
    prune record and the source's sha256 are stored as metadata (`prune_heads.*`). The file is written
    under no name and linked into place when complete. Raises GgufError before writing anything for what no
    GGUF file can hold, OutputExistsError for an existing file without `overwrite`.
    """
    import gguf

    arch = _arch_of(model)
    path, source = Path(path), _source(model, source)
    check_gguf(model, tokenizer, source, tensor_type, output=path, overwrite=overwrite)
    quantized = tensor_type if tensor_type in FILE_TYPES else None
    wanted = (None if quantized else tensor_type) or ("source" if source is not None else "f16")
    config: Any = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.names], config.num_hidden_layers)
    blocks = _blocks(model, names)
    if not any(b.kv_heads for b in blocks):
        raise GgufError(
            "the plan leaves no attention head in any layer: llama.cpp cannot run a model without a KV "
            "cache (it fails to allocate one); keep at least one KV group"
        )
    architecture = _architecture(blocks, arch, _model_type(model))
    targets = _targets(model, names, blocks, arch)
    if not arch.output_bias and any(n.endswith("attn_output.bias") and v.any() for n, v in targets.items()):
        raise GgufError(_BIAS_REFUSED.format(model_type=_model_type(model), arch=architecture))
    targets = {n: v for n, v in targets.items() if arch.output_bias or not n.endswith("attn_output.bias")}
    if architecture == UNEVEN:
        _attention_free(targets, blocks, bool(getattr(model.config, "tie_word_embeddings", False)))
    head_dim = max(b.layer.head_dim for b in blocks)
    result = GgufWrite(path, architecture, [b.heads for b in blocks], [b.kv_heads for b in blocks], file_type=quantized)
    reader = _reader(source) if source is not None else None
    by_index = {b.index: b for b in blocks}
    interleave = arch.interleaved and not arch.source_interleaved  # the source's q/k rows into the written order

    def write(out: Path) -> None:
        writer = gguf.GGUFWriter(out, architecture)
        even = architecture != UNEVEN
        counts = {
            f"{architecture}.attention.head_count": result.heads[0] if even else result.heads,
            f"{architecture}.attention.head_count_kv": result.kv_heads[0] if even else result.kv_heads,
            f"{architecture}.attention.key_length": head_dim,
            f"{architecture}.attention.value_length": head_dim,
        }
        record = getattr(model.config, RECORD_KEY, None)
        ours = {RECORD_FIELD: json.dumps(record or {}, sort_keys=True)}
        if source is not None:
            ours[DIGEST_FIELD] = _sha256(source)
            dropped = {f"{architecture}.{key}" for key in arch.dropped}
            _copy_fields(writer, reader, arch.source, architecture, set(counts) | set(ours) | dropped)
        else:
            _config_fields(writer, model, tokenizer, targets, head_dim, arch)
        for key, value in {**counts, **ours}.items():
            if isinstance(value, list):
                writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT32)
            elif isinstance(value, str):
                writer.add_string(key, value)
            else:
                writer.add_uint32(key, value)
        source_tensors = {t.name: t for t in reader.tensors} if reader is not None else {}
        if arch.fused:
            source_tensors = _unfused(source_tensors, by_index)
        # a source tensor the model has no weight for (rope_freqs) is copied, unless it is attention
        order = [n for n in source_tensors if n in targets or not re.match(r"blk\.\d+\.attn_", n)] + [
            n for n in targets if n not in source_tensors
        ]
        for name in order:
            raw = _unchanged(name, targets.get(name), source_tensors, by_index, interleave)
            if raw is not None:
                result.copied.append(name)
            else:
                like = source_tensors.get(name) or source_tensors.get(re.sub(r"^blk\.\d+\.", "blk.0.", name))
                raw = _encode(targets[name], wanted, like.tensor_type if like is not None else None)
                result.written[name] = raw[1].name
            writer.add_tensor(name, raw[0], raw_dtype=raw[1])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    def write_quantized(out: Path) -> None:
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".prune-heads-") as folder:
            write(Path(folder) / "unquantized.gguf")
            _quantize(Path(folder) / "unquantized.gguf", out, str(quantized))

    replace_file(path, overwrite, write_quantized if quantized else write)
    return result


def _quantize(source: Path, target: Path, file_type: str) -> None:
    """llama.cpp's own quantizer (the llama-cpp-python binding of `llama_model_quantize`) from `source` to
    `target` at `file_type`, re-quantizing tensors that are already quantized."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.allow_requantize = True
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if code != 0:
        raise GgufError(f"llama.cpp's quantizer failed on the written file (code {code}); try another --gguf-type")


def gguf_heads(path: str | Path) -> dict[str, Any]:
    """What a GGUF file holds, for `inspect`: architecture, per-layer heads and KV heads, and the prune record
    prune-heads stored in it (if any)."""
    reader = _reader(Path(path))
    arch = str(reader.fields["general.architecture"].contents())
    blocks = int(reader.fields[f"{arch}.block_count"].contents())

    def per_layer(key: str) -> list[int]:
        found = reader.fields.get(f"{arch}.attention.{key}")
        value = found.contents() if found is not None else 0
        return [int(v) for v in value] if isinstance(value, list) else [int(value)] * blocks

    record = reader.fields.get(RECORD_FIELD)
    digest = reader.fields.get(DIGEST_FIELD)
    return {
        "architecture": arch,
        "heads": per_layer("head_count"),
        "kv_heads": per_layer("head_count_kv"),
        "record": json.loads(record.contents()) if record is not None else None,
        "source_sha256": digest.contents() if digest is not None else None,
        "tensors": len(reader.tensors),
        "bytes": Path(path).stat().st_size,
    }
