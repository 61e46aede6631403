"""Reading a GGUF file back: the heads each layer kept."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .architectures import DIGEST_FIELD, RECORD_FIELD
from .writer import _reader


def gguf_heads(path: str | Path) -> dict[str, Any]:
    """What a GGUF file holds, for `inspect`: architecture, per-layer heads and KV heads, the head size, the
    prune record prune-heads stored in it (if any)."""
    reader = _reader(Path(path))
    arch = str(reader.fields["general.architecture"].contents())
    blocks = int(reader.fields[f"{arch}.block_count"].contents())

    def per_layer(key: str) -> list[int]:
        found = reader.fields.get(f"{arch}.attention.{key}")
        value = found.contents() if found is not None else 0
        return [int(v) for v in value] if isinstance(value, list) else [int(value)] * blocks

    key_length = reader.fields.get(f"{arch}.attention.key_length")  # llama.cpp's own default where absent
    width = int(reader.fields[f"{arch}.embedding_length"].contents())
    head_dim = int(key_length.contents()) if key_length is not None else width // per_layer("head_count")[0]
    record = reader.fields.get(RECORD_FIELD)
    digest = reader.fields.get(DIGEST_FIELD)
    return {
        "architecture": arch,
        "heads": per_layer("head_count"),
        "kv_heads": per_layer("head_count_kv"),
        "head_dim": head_dim,
        "record": json.loads(record.contents()) if record is not None else None,
        "source_sha256": digest.contents() if digest is not None else None,
        "tensors": len(reader.tensors),
        "bytes": Path(path).stat().st_size,
    }


def quantized(path: str | Path) -> bool:
    """Whether every matrix of the GGUF file is stored quantized (no F32 or F16 matrix; norms and biases are
    F32 in any file): bfloat16 holds such weights within a small share of their own quantization step."""
    import gguf

    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    matrices = [t for t in _reader(Path(path)).tensors if len(t.shape) > 1]
    return bool(matrices) and all(t.tensor_type not in plain for t in matrices)
