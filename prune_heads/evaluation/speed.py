"""Measured speed: latency, throughput, FLOPs, memory and, for decoders, generation and KV-cache size."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..model.inputs import dummy_inputs
from ..runtime.devices import to_device
from ..runtime.memory import weight_bytes
from ..runtime.work import count_flops


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakAllocations(TorchDispatchMode):
    """Bytes of the tensor storages created inside this mode that are still alive, and their peak.

    Measures CPU memory without the torch profiler, whose kineto backend prints to stderr. Views and in-place
    results share an existing storage and are not counted again; a storage stops counting when it is freed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self._alive: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.current -= nbytes
        self._alive.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._alive or storage.nbytes() == 0:
                continue
            self._alive.add(key)
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


def _peak_memory(model: nn.Module, inputs: dict, device: torch.device) -> int:
    """Peak bytes allocated during one forward: CUDA's allocator statistics, or on CPU the weights plus the
    peak of the tensors the forward creates (see PeakAllocations)."""
    weights = weight_bytes(model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        with torch.no_grad():
            model(**inputs)
        return int(torch.cuda.max_memory_allocated(device))
    with torch.no_grad(), PeakAllocations() as allocations:
        model(**inputs)
    return int(weights + allocations.peak)


def kv_cache_bytes(cache: Any) -> int:
    """Bytes held by the keys and values of a transformers cache."""
    layers = getattr(cache, "layers", None)
    if layers is None and hasattr(cache, "self_attention_cache"):
        return kv_cache_bytes(cache.self_attention_cache) + kv_cache_bytes(cache.cross_attention_cache)
    total = 0
    for layer in layers or []:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if torch.is_tensor(tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def _prepare(model: nn.Module, device, dtype) -> torch.device:
    if device is not None:
        model.to(device)
    if dtype is not None:
        model.to(dtype)
    model.eval()
    return next(model.parameters()).device


def _latencies(models: list[nn.Module], inputs: list[dict], repeats: int, warmup: int) -> list[list[float]]:
    """Forward-pass seconds of each model, the models taking turns so that machine noise hits all alike."""
    times: list[list[float]] = [[] for _ in models]
    with torch.no_grad():
        for i in range(warmup + repeats):
            for k, (model, x) in enumerate(zip(models, inputs)):
                device = next(model.parameters()).device
                _sync(device)
                start = time.perf_counter()
                model(**x)
                _sync(device)
                if i >= warmup:
                    times[k].append(time.perf_counter() - start)
    return [sorted(t) for t in times]


def benchmark_pair(before: nn.Module, after: nn.Module, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """`benchmark` two models (say, before and after pruning) in one run with interleaved repeats, so their
    ratio is not skewed by the machine's state changing between two runs. Same keyword arguments."""
    pair = benchmark([before, after], **kwargs)
    assert isinstance(pair, list)  # a list in, a list out
    return pair[0], pair[1]


@dataclass(frozen=True)
class SpeedConfig:
    """How speed is measured (`ph.benchmark`): the timing batch, `repeats` timed runs after `warmup` ones,
    CPU threads (None: torch's), and with `generate_tokens` > 0 greedy generation at each of
    `generate_batch_sizes` (default: the timing batch)."""

    batch_size: int = 8
    seq_len: int = 128
    repeats: int = 10
    warmup: int = 2
    threads: int | None = None
    generate_tokens: int = 0
    generate_batch_sizes: list[int] = field(default_factory=list)


def benchmark(
    model: nn.Module | list[nn.Module],
    config: SpeedConfig | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    inputs: dict[str, torch.Tensor] | None = None,
    **options: Any,
) -> dict[str, Any] | list[dict[str, Any]]:
    """Time the model's forward pass and report what users compare before and after pruning.

    Returns latency (median and p90 over the repeats after the warmup runs, CUDA synchronised), throughput
    (examples/s, tokens/s), parameters, FLOPs per forward, peak memory, and for models that generate with
    `generate_tokens` > 0, greedy generation tokens/s and the KV-cache bytes after it (under "generation",
    one entry per batch size). How it measures is a `SpeedConfig`, or its fields as keywords
    (`benchmark(model, batch_size=1)`); the settings are recorded in the result. The model runs on `device`
    in `dtype` (default: where and as it is); `inputs` replaces the random ones. Given a list of models, times
    them in turns and returns one result per model.
    """
    settings = dataclasses.replace(config or SpeedConfig(), **options)
    models = model if isinstance(model, list) else [model]
    with _threads(settings.threads):
        results = _benchmarked(models, settings, device, dtype, inputs)
    return results if isinstance(model, list) else results[0]


@contextlib.contextmanager
def _threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `threads` inside (left as they are where None), then set back: the
    caller's process keeps its own."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _benchmarked(
    models: list[nn.Module], settings: SpeedConfig, device: Any, dtype: Any, inputs: dict | None
) -> list[dict[str, Any]]:
    """Each model timed, in turns, as `benchmark` says."""
    devices = [_prepare(m, device, dtype) for m in models]
    base = inputs if inputs is not None else dummy_inputs(models[0], settings.batch_size, settings.seq_len)
    batches = [{k: v.to(d) for k, v in base.items()} for d in devices]
    timings = _latencies(models, batches, settings.repeats, settings.warmup)
    results = []
    for m, d, x, times in zip(models, devices, batches, timings):
        result = _timed(m, x, d, times, settings)
        size = result["settings"]["batch_size"]
        if settings.generate_tokens and getattr(m, "can_generate", lambda: False)():
            result["generation"] = [
                _generation(
                    m,
                    x if b == size else to_device(dummy_inputs(m, b, settings.seq_len), d),
                    settings.generate_tokens,
                    d,
                )
                for b in settings.generate_batch_sizes or [size]
            ]
            result.update(result["generation"][0])
        results.append(result)
    return results


def _timed(
    model: nn.Module, inputs: dict, device: torch.device, times: list[float], settings: SpeedConfig
) -> dict[str, Any]:
    """One model's latency, throughput, size, FLOPs and peak memory, with the settings it was timed at."""
    examples = next(iter(inputs.values())).shape[0]
    tokens = examples * (inputs["input_ids"].shape[1] if "input_ids" in inputs else 1)
    median = statistics.median(times)
    return {
        "latency_ms": 1000 * median,
        "latency_p90_ms": 1000 * times[min(len(times) - 1, int(0.9 * len(times)))],
        "examples_per_s": examples / median,
        "tokens_per_s": tokens / median,
        "parameters": sum(p.numel() for p in model.parameters()),
        "flops": count_flops(model, inputs),
        "peak_memory_bytes": _peak_memory(model, inputs, device),
        "settings": {
            "batch_size": examples,
            "seq_len": settings.seq_len if "input_ids" in inputs else None,
            "device": str(device),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(),
            "repeats": settings.repeats,
            "warmup": settings.warmup,
        },
    }


def _generation(model: Any, inputs: dict, new_tokens: int, device: torch.device) -> dict[str, Any]:
    prompt = {k: v for k, v in inputs.items() if k != "decoder_input_ids"}
    kwargs = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        pad_token_id=model.config.get_text_config().pad_token_id or 0,
    )
    with torch.no_grad():
        model.generate(**prompt, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        _sync(device)
        start = time.perf_counter()
        out = model.generate(**prompt, **kwargs)
        _sync(device)
    elapsed = time.perf_counter() - start
    batch = next(iter(prompt.values())).shape[0]
    return {
        "batch_size": batch,
        "new_tokens": new_tokens,
        "generate_tokens_per_s": batch * new_tokens / elapsed,
        "kv_cache_bytes": kv_cache_bytes(out.past_key_values),
    }
