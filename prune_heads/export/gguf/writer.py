"""Writing the GGUF file: the checks before anything is written, the metadata (copied from the source or made
from the config), the tensors, and llama.cpp's own quantizer for whole-file types."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from ...config import _BLOCKED, FILE_TYPES, GGUF_TYPES
from ...model.layers import find_attention
from ...model.surgery import RECORD_KEY
from ..persistence import GGUF_SOURCE, ensure_file_free, replace_file
from .architectures import (
    DIGEST_FIELD,
    RECORD_FIELD,
    UNEVEN,
    GgufArch,
    GgufError,
    _arch_of,
    _model_type,
    _rope,
)
from .tensors import (
    _BIAS_REFUSED,
    _UNEVEN_REFUSED,
    Held,
    _architecture,
    _attention_free,
    _Block,
    _blocks,
    _encode,
    _targets,
    _unchanged,
    _unfused,
)
from .tokenizer import _backend, _byte_level, _pre_tokenizer, _scores, _space_prefix, _vocabulary, tokenizer_model


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


def _source(model: nn.Module, source: str | Path | None) -> Path | None:
    path = source if source is not None else getattr(model, GGUF_SOURCE, None)
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
    _check_packages(tensor_type)
    arch = _arch_of(model)
    _check_function(model, arch, uniform, output_biases)
    if output is not None:
        ensure_file_free(Path(output), overwrite)
    layers = find_attention(model)
    _check_source(model, arch, _source(model, source), tokenizer, layers)
    for layer in layers:
        if tensor_type in _BLOCKED and layer.head_dim % 32:
            raise GgufError(
                f"{tensor_type} packs rows in blocks of 32 values; head_dim {layer.head_dim} does not "
                f"split into them: use f16 or f32"
            )


def _check_packages(tensor_type: str | None) -> None:
    """The gguf package, a known tensor type, and llama.cpp's quantizer for a whole-file type."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise GgufError("GGUF output needs the gguf package: pip install 'prune-heads[gguf]'") from None
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


def _check_function(model: nn.Module, arch: GgufArch, uniform: bool | None, output_biases: bool | None) -> None:
    """That llama.cpp's architecture computes what the pruned model computes: its attention scale, rope,
    one head count for all layers where it takes only one, and output biases only where it loads them."""
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


def _check_source(model: nn.Module, arch: GgufArch, path: Path | None, tokenizer: Any, layers: list) -> None:
    """A source file of the model's architecture, or else a config and a tokenizer llama.cpp takes."""
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
    arch = _arch_of(model)
    path, source = Path(path), _source(model, source)
    check_gguf(model, tokenizer, source, tensor_type, output=path, overwrite=overwrite)
    quantized = tensor_type if tensor_type in FILE_TYPES else None
    wanted = (None if quantized else tensor_type) or ("source" if source is not None else "f16")
    layout = _layout(model, arch)
    heads, kv_heads = [b.heads for b in layout.blocks], [b.kv_heads for b in layout.blocks]
    result = GgufWrite(path, layout.architecture, heads, kv_heads, file_type=quantized)

    def write(out: Path) -> None:
        import gguf

        writer = gguf.GGUFWriter(out, layout.architecture)
        reader = _reader(source) if source is not None else None
        _metadata(writer, model, arch, layout, source, reader, tokenizer)
        _tensors(writer, arch, layout, reader, wanted, result)
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


@dataclass
class _Layout:
    """What a model's file holds: its attention blocks, llama.cpp's architecture for them, every tensor by
    its GGUF name (as the model holds it) and the head size."""

    blocks: list[_Block]
    architecture: str
    targets: dict[str, np.ndarray]
    head_dim: int
    held: Held


def _layout(model: nn.Module, arch: GgufArch) -> _Layout:
    """The model's tensors named and laid out for `arch`; what the chosen architecture cannot hold (no KV
    cache at all, output biases where it loads none) is refused."""
    import gguf

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
    held = Held(next(model.parameters()).dtype, arch.norm_shift)
    return _Layout(blocks, architecture, targets, max(b.layer.head_dim for b in blocks), held)


def _metadata(
    writer, model: nn.Module, arch: GgufArch, layout: _Layout, source: Path | None, reader, tokenizer: Any
) -> None:
    """The file's metadata: the source's (copied) or the config's and the tokenizer's, then the head counts
    of the pruned layers and prune-heads' own record (and the source's sha256)."""
    import gguf

    architecture, heads, kv_heads = (
        layout.architecture,
        [b.heads for b in layout.blocks],
        [b.kv_heads for b in layout.blocks],
    )
    even = architecture != UNEVEN
    counts = {
        f"{architecture}.attention.head_count": heads[0] if even else heads,
        f"{architecture}.attention.head_count_kv": kv_heads[0] if even else kv_heads,
        f"{architecture}.attention.key_length": layout.head_dim,
        f"{architecture}.attention.value_length": layout.head_dim,
    }
    record = getattr(model.config, RECORD_KEY, None)
    ours = {RECORD_FIELD: json.dumps(record or {}, sort_keys=True)}
    if source is not None:
        ours[DIGEST_FIELD] = _sha256(source)
        dropped = {f"{architecture}.{key}" for key in arch.dropped}
        _copy_fields(writer, reader, arch.source, architecture, set(counts) | set(ours) | dropped)
    else:
        _config_fields(writer, model, tokenizer, layout.targets, layout.head_dim, arch)
    for key, value in {**counts, **ours}.items():
        if isinstance(value, list):
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT32)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)


def _tensors(writer, arch: GgufArch, layout: _Layout, reader, wanted: str, result: GgufWrite) -> None:
    """Every tensor: copied byte for byte from the source where the model still holds its values (q/k/v with
    the removed heads' rows dropped), else written anew in `wanted`; `result` says which went which way."""
    by_index = {b.index: b for b in layout.blocks}
    interleave = arch.interleaved and not arch.source_interleaved  # the source's q/k rows into the written order
    targets = layout.targets
    source_tensors = {t.name: t for t in reader.tensors} if reader is not None else {}
    if arch.fused:
        source_tensors = _unfused(source_tensors, by_index)
    # a source tensor the model has no weight for (rope_freqs) is copied, unless it is attention
    order = [n for n in source_tensors if n in targets or not re.match(r"blk\.\d+\.attn_", n)] + [
        n for n in targets if n not in source_tensors
    ]
    for name in order:
        raw = _unchanged(name, targets.get(name), source_tensors, by_index, interleave, layout.held)
        if raw is not None:
            result.copied.append(name)
        else:
            like = source_tensors.get(name) or source_tensors.get(re.sub(r"^blk\.\d+\.", "blk.0.", name))
            raw = _encode(targets[name], wanted, like.tensor_type if like is not None else None)
            result.written[name] = raw[1].name
        writer.add_tensor(name, raw[0], raw_dtype=raw[1])


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
