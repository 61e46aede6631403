"""How fast llama.cpp runs a GGUF file on this machine (llama-cpp-python, the `llamacpp` extra): a prompt that
fills the context less DECODE_TOKENS, then DECODE_TOKENS decoded one at a time, with flash attention (a V cache
whose size differs between layers is padded without it) and the KV cache in one of llama.cpp's cache types."""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

from .architectures import GgufError

GGML_CACHE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
DECODE_TOKENS = 32


@dataclass(frozen=True)
class LlamaSpeed:
    """Prompt and decode tokens a second in llama.cpp."""

    prompt: float
    decode: float


def llama_cpp_installed() -> bool:
    """Whether llama-cpp-python can be imported (without importing it: it loads a native library)."""
    return importlib.util.find_spec("llama_cpp") is not None


def llama_speed(
    path: str | Path, ids: list[int], context: int, cache_type: str = "f16", threads: int | None = None, **options
) -> LlamaSpeed:
    """llama.cpp's prompt and decode speed on `path` at `context` tokens, the prompt `ids` repeated to fill it
    (the content does not change the work), the KV cache in `cache_type`; `options` go to `llama_cpp.Llama`."""
    if not llama_cpp_installed():
        raise GgufError("measuring llama.cpp's speed needs llama-cpp-python: pip install 'prune-heads[llamacpp]'")
    from llama_cpp import Llama

    if context <= DECODE_TOKENS or not ids:
        raise GgufError(f"a speed run needs a context above {DECODE_TOKENS} tokens and some token ids")
    tokens = (ids * (context // len(ids) + 1))[:context]
    kind = GGML_CACHE_TYPES[cache_type]
    llm = Llama(
        model_path=str(path),
        n_ctx=context,
        n_batch=512,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=True,
        type_k=kind,
        type_v=kind,
        **{"verbose": False, **options},
    )
    tick = time.perf_counter()
    llm.eval(tokens[:-DECODE_TOKENS])
    prompt = (context - DECODE_TOKENS) / (time.perf_counter() - tick)
    tick = time.perf_counter()
    for token in tokens[-DECODE_TOKENS:]:
        llm.eval([token])
    return LlamaSpeed(prompt, DECODE_TOKENS / (time.perf_counter() - tick))
