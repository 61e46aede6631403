"""A run's models in llama.cpp: the frontier's depths timed there, and a written file checked against its GGUF
source."""

from __future__ import annotations

import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..export.gguf import LlamaCheck, llama_checks, llama_cpp_installed, llama_speed, save_gguf
from ..model.layers import find_attention
from ..model.probe import prune
from ..pruner import FRONTIER_CACHE_TYPES, PruneResult
from ..recipes import Recipe
from ..runtime.progress import progress_bar
from ..scoring.kv_cache import fits_cache
from ..task_data import TaskData
from .loading import gguf_file, load_processor, task_data


def frontier_in_llama_cpp(recipe: Recipe, plan: dict | None) -> bool:
    """Whether the frontier's depths are timed in llama.cpp: GGUF out, depths asked, llama-cpp-python here."""
    return plan is None and recipe.written.format == "gguf" and bool(recipe.selection.depths) and llama_cpp_installed()


def llama_speeds(
    recipe: Recipe, original: Any, found: PruneResult, processor: Any, score: TaskData | None, progress: bool
) -> list[dict[str, dict[str, float]]]:
    """llama.cpp's prompt and decode speed at the frontier's context per cache type at each depth (the first
    the unpruned model): its plan removed from `original` in place, depth after depth (the plans are nested, and
    the speed depends on the shapes, not on the refitted values), each file written as the output is."""
    assert score is not None  # scored whenever the frontier is measured
    ids = [int(i) for b in score.batches for i in b["input_ids"][b["attention_mask"].bool()]]
    caches = [c for c in FRONTIER_CACHE_TYPES if fits_cache(find_attention(original), c)]
    speeds = []
    runs = len(found.frontier) * len(caches)
    threads = torch.get_num_threads()  # llama.cpp on the cores torch uses, not its own default
    with tempfile.TemporaryDirectory() as tmp, progress_bar(None, "llama.cpp", runs, progress) as bar:
        for depth in found.frontier:  # the unpruned model first
            present = {layer.name: layer.heads for layer in find_attention(original)}
            prune(original, {n: [h for h in heads if h in present[n]] for n, heads in depth.plan.items()})
            file = Path(tmp) / "depth.gguf"
            save_gguf(original, file, tokenizer=processor, tensor_type=recipe.written.gguf_type, overwrite=True)
            speeds.append({c: asdict(llama_speed(file, ids, recipe.selection.context, c, threads)) for c in caches})
            bar.update(len(caches))
    return speeds


def check_before_and_after(recipe: Recipe) -> Path:
    """The recipe's GGUF source, where `before_and_after` can check its run in llama.cpp (refused before the run
    otherwise: no GGUF source, no evaluation split, or no llama-cpp-python)."""
    source = gguf_file(recipe)
    if source is None:
        raise ConfigError(
            f"{recipe.model} is not read from a GGUF file that is there: give model_kwargs.gguf_file, a file in it"
        )
    if recipe.data.eval_split is None:
        raise ConfigError("checking perplexity in llama.cpp needs an evaluation split: give data.eval_split")
    if not llama_cpp_installed():
        raise ConfigError("checking a GGUF file in llama.cpp needs llama-cpp-python: pip install '.[llamacpp]'")
    return source


def before_and_after(recipe: Recipe, written: Path, context: int, repeats: int = 3) -> list[LlamaCheck]:
    """The recipe's GGUF source and the file its run wrote, checked in llama.cpp: sizes, KV caches and speeds at
    `context` (on as many threads as torch uses), and perplexity on the recipe's evaluation split."""
    source, d = check_before_and_after(recipe), recipe.data
    assert d.eval_split is not None  # checked above
    windows = task_data(recipe, None, load_processor(recipe), d.eval_split, d.eval_examples).batches
    return llama_checks([source, written], windows, context, repeats, torch.get_num_threads())
