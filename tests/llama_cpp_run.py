"""llama.cpp as the GGUF tests run it (llama-cpp-python, the `llamacpp` extra): a prompt's logits, greedy
tokens and tokenization."""

from __future__ import annotations

from pathlib import Path

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
