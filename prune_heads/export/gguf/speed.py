"""A GGUF file run in llama.cpp on this machine (llama-cpp-python, the `llamacpp` extra): how fast (a prompt that
fills the context less DECODE_TOKENS, then DECODE_TOKENS decoded one at a time, with flash attention: a V cache
whose size differs between layers is padded without it; the KV cache in one of llama.cpp's cache types) and its
perplexity on token windows, for a check of a written file before and after pruning."""

from __future__ import annotations

import importlib.util
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .architectures import GgufError

GGML_CACHE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
DECODE_TOKENS = 32


@dataclass(frozen=True)
class LlamaSpeed:
    """Prompt and decode tokens a second in llama.cpp."""

    prompt: float
    decode: float


@dataclass(frozen=True)
class LlamaCheck:
    """One GGUF file in llama.cpp: its bytes, its KV cache at the speed run's context (f16 keys and values),
    its perplexity on the windows given and its speed at that context."""

    path: str
    bytes: int
    kv_cache: int
    perplexity: float
    speed: LlamaSpeed


def llama_cpp_installed() -> bool:
    """Whether llama-cpp-python can be imported (without importing it: it loads a native library)."""
    return importlib.util.find_spec("llama_cpp") is not None


def llama_speed(
    path: str | Path, ids: list[int], context: int, cache_type: str = "f16", threads: int | None = None, **options
) -> LlamaSpeed:
    """llama.cpp's prompt and decode speed on `path` at `context` tokens, the prompt `ids` repeated to fill it
    (the content does not change the work), the KV cache in `cache_type`; `options` go to `llama_cpp.Llama`."""
    if context <= DECODE_TOKENS or not ids:
        raise GgufError(f"a speed run needs a context above {DECODE_TOKENS} tokens and some token ids")
    tokens = (ids * (context // len(ids) + 1))[:context]
    llm = _llama(path, context, cache_type, threads, **options)
    tick = time.perf_counter()
    llm.eval(tokens[:-DECODE_TOKENS])
    prompt = (context - DECODE_TOKENS) / (time.perf_counter() - tick)
    tick = time.perf_counter()
    for token in tokens[-DECODE_TOKENS:]:
        llm.eval([token])
    return LlamaSpeed(prompt, DECODE_TOKENS / (time.perf_counter() - tick))


def _llama(path: str | Path, context: int, cache_type: str, threads: int | None, **options: Any) -> Any:
    """llama.cpp on `path` at `context` tokens with flash attention, the KV cache in `cache_type`, `threads`
    threads (llama.cpp's own count where None); `options` go to `llama_cpp.Llama`."""
    if not llama_cpp_installed():
        raise GgufError("running a GGUF file in llama.cpp needs llama-cpp-python: pip install 'prune-heads[llamacpp]'")
    from llama_cpp import Llama

    kind = GGML_CACHE_TYPES[cache_type]
    return Llama(
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


def llama_perplexity(
    path: str | Path, windows: list[dict], threads: int | None = None, cache_type: str = "f16"
) -> float:
    """exp of the mean next-token NLL llama.cpp gives the labelled tokens of `windows` (batches of a causal-lm
    `TaskData`: input_ids, attention_mask, labels), each window evaluated alone from an empty cache."""
    import numpy as np
    import torch

    longest = max(int(b["attention_mask"].sum(-1).max()) for b in windows)
    llm = _llama(path, longest, cache_type, threads, logits_all=True)
    total, count = 0.0, 0
    for batch in windows:
        for ids, mask, labels in zip(batch["input_ids"], batch["attention_mask"], batch["labels"]):
            ids, labels = ids[mask.bool()].tolist(), labels[mask.bool()]
            llm.reset()
            llm.eval(ids)
            logits = torch.tensor(np.array(llm.scores[: len(ids)]))[:-1]
            nll = torch.nn.functional.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum")
            total, count = total + float(nll), count + int((labels[1:] != -100).sum())
    return math.exp(total / count)


def llama_checks(
    paths: list[str | Path], windows: list[dict], context: int, repeats: int = 2, threads: int | None = None
) -> list[LlamaCheck]:
    """Each of `paths` in llama.cpp: its size, KV cache at `context`, perplexity on `windows` and speed at
    `context` (the prompt the windows' first tokens), the speed runs in turns `repeats` times and the fastest
    kept, so a busy moment of the machine falls on every file alike."""
    from .inspect import gguf_heads

    ids = [int(t) for t in windows[0]["input_ids"][0][windows[0]["attention_mask"][0].bool()]]
    runs = [[llama_speed(path, ids, context, threads=threads) for path in paths] for _ in range(repeats)]
    found = []
    for i, path in enumerate(paths):
        held = gguf_heads(path)
        kv_cache = 2 * 2 * context * held["head_dim"] * sum(held["kv_heads"])  # keys and values, 2 bytes each
        fastest = LlamaSpeed(max(r[i].prompt for r in runs), max(r[i].decode for r in runs))
        perplexity = llama_perplexity(path, windows, threads)
        found.append(LlamaCheck(str(path), held["bytes"], kv_cache, perplexity, fastest))
    return found
