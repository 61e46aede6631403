"""llama.cpp as the GGUF tests run it (llama-cpp-python, the `llamacpp` extra): a prompt's logits, greedy
tokens, tokenization, and llama.cpp's own quantizer."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama

F32 = 0  # GGML_TYPE_F32: a KV cache in float32, so an f32 file is compared without f16 rounding


def run(
    path: str | Path, ids: list[int], new_tokens: int = 32, f32_cache: bool = False
) -> tuple[np.ndarray, list[int]]:
    """The logits of every prompt position [len(ids), vocab] and `new_tokens` greedy tokens after it."""
    extra = {"type_k": F32, "type_v": F32} if f32_cache else {}
    llm = Llama(model_path=str(path), n_ctx=128, n_batch=128, n_threads=2, logits_all=True, verbose=False, **extra)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)])
    greedy = []
    for _ in range(new_tokens):
        greedy.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(greedy[-1:])
    return logits, greedy


def tokenize(path: str | Path, text: str) -> list[int]:
    """llama.cpp's token ids for `text` with the file's vocabulary (no BOS, special tokens parsed)."""
    return Llama(model_path=str(path), vocab_only=True, verbose=False).tokenize(
        text.encode(), add_bos=False, special=True
    )


def quantize(source: str | Path, target: str | Path, ftype: str) -> Path:
    """llama.cpp's own quantizer (llama_model_quantize) at `ftype`, e.g. "Q8_0" or "Q4_K_M"; tensors that are
    already quantized are re-quantized (llama-quantize --allow-requantize)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    params.allow_requantize = True
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    assert code == 0, f"llama_model_quantize returned {code}"
    return Path(target)
