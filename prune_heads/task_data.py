"""Task data: load a split (hub name or local files), tokenize it, and batch it for the model."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch

from .errors import PruneHeadsError
from .runtime.progress import library_bars

TASKS = ("classification", "causal-lm", "feature-extraction", "image-classification")
# the class-name endings of the models that can run each task (feature extraction takes any model)
TASK_HEADS = {
    "classification": ("ForSequenceClassification",),
    "image-classification": ("ForImageClassification",),
    "causal-lm": ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"),
}
_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


class DataError(PruneHeadsError, ValueError):
    """A data source, split or column that does not exist; the message lists what does."""


@dataclass
class TaskData:
    """Batches ready for the model (dicts of tensors, with `labels` where the task has them; an embedding
    model's labels, for task metrics, in `targets`)."""

    task: str
    batches: list[dict[str, torch.Tensor]]
    num_examples: int
    label_names: list[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    targets: list[int] | None = None  # labels of a feature-extraction task, in batch order (the model takes none)

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    def without_labels(self) -> list[dict[str, torch.Tensor]]:
        """The same batches with the labels dropped (for label-free scoring)."""
        return [without_labels(b) for b in self.batches]


def batch_size(batch: dict) -> int:
    """Number of examples in a batch (the leading dimension of its first tensor)."""
    return next(v.shape[0] for v in batch.values() if torch.is_tensor(v))


def with_targets(data: TaskData | Iterable[dict]) -> list[dict]:
    """The batches of `data` as a list; those of a feature-extraction `TaskData` with `targets` carry their
    examples' class labels as `labels` (which only the scoring objective's probe reads, never the model)."""
    batches = list(data)
    if not isinstance(data, TaskData) or data.targets is None:
        return batches
    labels, start = torch.tensor(data.targets), 0
    for i, batch in enumerate(batches):
        rows = batch_size(batch)
        batches[i], start = {**batch, "labels": labels[start : start + rows]}, start + rows
    return batches


def without_labels(batch: dict) -> dict:
    """The batch without its `labels` (for the label-free objective)."""
    return {k: v for k, v in batch.items() if k != "labels"}


@library_bars()
def load_split(source: str, split: str = "validation", name: str | None = None) -> datasets.Dataset:
    """One split of a dataset: a hub name, a local file (csv, tsv, json, jsonl, parquet, txt) or a folder of
    files named after their splits (`validation.jsonl`). `split` may slice, as in `train[:2048]`.
    Raises DataError naming the splits that exist when the split does not.
    """
    split_name = re.split(r"[\[+]", split, maxsplit=1)[0]
    path = Path(source)
    try:
        if path.is_file():
            builder = _builder(path)
            return datasets.load_dataset(
                builder,
                data_files={split_name: str(path)},
                split=split,
                **({"delimiter": "\t"} if path.suffix == ".tsv" else {}),
            )
        if path.is_dir() and any(p.suffix in _BUILDERS for p in path.iterdir()):
            files = {p.stem: str(p) for p in sorted(path.iterdir()) if p.suffix in _BUILDERS}
            if split_name not in files:
                raise DataError(f"no split {split_name!r} in {source}; it has {', '.join(files)}")
            builder = _builder(Path(files[split_name]))
            return datasets.load_dataset(builder, data_files={split_name: files[split_name]}, split=split)
        return datasets.load_dataset(source, name, split=split)
    except DataError:
        raise
    except StopIteration:  # datasets' readers on an empty file
        raise DataError(f"split {split!r} of {source} has no examples; give a file or split with data") from None
    except ValueError as error:  # unknown split, bad slice, unreadable rows
        raise DataError(f"split {split!r} of {source}: {str(error).splitlines()[0]}") from None
    except (FileNotFoundError, ConnectionError, OSError) as error:
        raise DataError(
            f"cannot load dataset {source!r} ({type(error).__name__}: {str(error).splitlines()[0]}); "
            f"give a local file or folder, or check the name and your network"
        ) from None


def _builder(path: Path) -> str:
    if path.suffix not in _BUILDERS:
        raise DataError(f"{path}: unknown file type {path.suffix!r}; use one of {', '.join(_BUILDERS)}")
    return _BUILDERS[path.suffix]


def _column(dataset: datasets.Dataset, column: str | None, role: str) -> str:
    """`column`, checked to be one of the dataset's (DataError naming those that are)."""
    if column is None or column not in dataset.column_names:
        raise DataError(
            f"no {role} column {column!r}; the data has columns {', '.join(dataset.column_names)} "
            f"(set the {role} column)"
        )
    return column


def _labels(dataset: datasets.Dataset, column: str, label2id: dict[str, int] | None) -> tuple[list, list | None]:
    values = dataset[column]
    feature = dataset.features[column]
    names = getattr(feature, "names", None)
    if isinstance(values[0], str) or names:
        strings = [names[v] for v in values] if names else values
        if label2id:
            unknown = sorted(set(strings) - set(label2id))
            if unknown:
                raise DataError(f"labels {unknown[:5]} are not among the model's labels {sorted(label2id)}")
            return [label2id[s] for s in strings], sorted(label2id, key=lambda s: label2id[s])
        vocabulary = names or sorted(set(strings))
        return [vocabulary.index(s) for s in strings], list(vocabulary)
    return values, None


@dataclass(frozen=True)
class DataConfig:
    """Where the examples come from and how they are batched: a recipe's `data` section, and what
    `load_task_data` reads. No `source`: a decoder-only language model calibrates on `score_examples`
    sequences of `max_length` tokens it writes itself (128 by default)."""

    source: str | None = None
    score_split: str = "validation"
    eval_split: str | None = None
    text_column: str = "sentence"
    text_pair_column: str | None = None
    label_column: str | None = "label"
    image_column: str = "image"
    name: str | None = None
    max_length: int = 128
    batch_size: int = 32
    score_examples: int | None = None
    eval_examples: int | None = None
    stride: int | None = None
    general_source: str | None = None  # the general-ability guard's text and the depths' second text (its score split)
    heal_source: str | None = None  # the heal's corpus (recovery.heal), in place of the model's written text
    heal_split: str = "train"


def load_task_data(
    data: DataConfig | str,
    tokenizer: Any = None,
    task: str = "classification",
    split: str | None = None,
    max_examples: int | None = None,
    label2id: dict[str, int] | None = None,
    image_processor: Any = None,
    by_length: bool = True,
    **options: Any,
) -> TaskData:
    """Load a split of `data` (a `DataConfig`, or its source alone with its other fields as keywords:
    `text_column="text", max_length=512`) and turn it into padded batches for `task`; `split` is the config's
    `score_split` unless given.

    Tasks: "classification" (single text or a pair, labels), "causal-lm" (the texts joined and cut into
    windows of `max_length` tokens, each starting with the BOS token where the tokenizer adds one; `stride` <
    max_length overlaps them and masks the overlap, as for sliding-window perplexity), "feature-extraction"
    (texts, and with `label_column` their labels in `targets` for task metrics), "image-classification"
    (images through `image_processor`, labels). String labels map through `label2id` (the model config's). Batches are
    padded to their own longest example; with `by_length` (default) text examples are batched in order of
    their token count, so a batch holds examples of similar length and padding costs little. Missing splits and
    columns are DataError with what exists.
    """
    d = _data_config(data, options)
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    assert d.source is not None  # refused by _data_config
    dataset = _examples(d.source, split or d.score_split, d.name, max_examples)
    if task == "image-classification":
        _column(dataset, d.image_column, "image")
        classes, class_names = _labels(dataset, _column(dataset, d.label_column, "label"), label2id)
        return _image_data(dataset[d.image_column], classes, class_names, image_processor, d.batch_size)
    texts = list(dataset[_column(dataset, d.text_column, "text")])
    if task == "causal-lm":
        return _lm_windows(texts, tokenizer, d.max_length, d.stride, d.batch_size)
    pairs = list(dataset[_column(dataset, d.text_pair_column, "text pair")]) if d.text_pair_column else None
    labels, names = None, None
    if task == "classification" or task == "feature-extraction" and d.label_column:
        labels, names = _labels(dataset, _column(dataset, d.label_column, "label"), label2id)
    encoded = tokenizer(texts, pairs, truncation=True, max_length=d.max_length)
    # batches of similar lengths (stable order by token count): padding no longer doubles the work
    order = sorted(range(len(texts)), key=lambda i: len(encoded["input_ids"][i])) if by_length else range(len(texts))
    batches = _text_batches(encoded, tokenizer, list(order), d.batch_size)
    if labels is None:
        return TaskData(task, batches, len(texts), names)
    ordered = [labels[i] for i in order]
    if task == "feature-extraction":  # the model takes no labels: they travel beside, for task metrics
        return TaskData(task, batches, len(texts), names, targets=ordered)
    for batch, start in zip(batches, range(0, len(ordered), d.batch_size)):
        batch["labels"] = torch.tensor(ordered[start : start + d.batch_size])
    return TaskData(task, batches, len(texts), names)


def _data_config(data: DataConfig | str, options: dict[str, Any]) -> DataConfig:
    """`data` as a DataConfig: a source with its fields as keywords, or a config given whole (without them)."""
    if isinstance(data, DataConfig):
        if options:
            raise TypeError(f"give the data's fields in its DataConfig or as keywords, not both: {sorted(options)}")
        found = data
    else:
        found = DataConfig(source=data, **options)
    if found.source is None:
        raise DataError("no data source: give a dataset name or a file (data.source, --data)")
    return found


def _examples(source: str, split: str, name: str | None, max_examples: int | None) -> datasets.Dataset:
    """The split, at most `max_examples` of it; DataError when it is empty."""
    dataset = load_split(source, split, name)
    if len(dataset) == 0:
        raise DataError(f"split {split!r} of {source} has no examples; give a file or split with data")
    return dataset if max_examples is None else dataset.select(range(min(max_examples, len(dataset))))


def _image_data(images: list, labels: list, names: list | None, processor: Any, batch_size: int) -> TaskData:
    """Images through the model's image processor, with their labels, `batch_size` at a time."""
    batches = []
    for start in range(0, len(images), batch_size):
        rgb = [im.convert("RGB") for im in images[start : start + batch_size]]
        pixels = processor(images=rgb, return_tensors="pt")["pixel_values"]
        batches.append({"pixel_values": pixels, "labels": torch.tensor(labels[start : start + batch_size])})
    return TaskData("image-classification", batches, len(images), names)


def _text_batches(encoded: Any, tokenizer: Any, order: list[int], batch_size: int) -> list[dict]:
    """The encoded examples in `order`, `batch_size` at a time, each batch padded to its longest."""
    return [
        dict(
            tokenizer.pad(
                {k: [v[i] for i in order[start : start + batch_size]] for k, v in encoded.items()}, return_tensors="pt"
            )
        )
        for start in range(0, len(order), batch_size)
    ]


def _leading_bos(tokenizer: Any) -> torch.Tensor | None:
    """The beginning-of-sequence token the tokenizer starts every text with (Gemma's <bos>), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    first = tokenizer("a")["input_ids"][:1]
    return torch.tensor([bos]) if bos is not None and first == [bos] else None


def _lm_windows(texts: list[str], tokenizer: Any, max_length: int, stride: int | None, batch_size: int) -> TaskData:
    """The texts joined and cut into windows of `max_length` tokens, each advanced `stride` tokens (default: no
    overlap) with the overlap masked. A tokenizer that starts every text with a BOS token (models trained
    so, like Gemma, drift far without one) starts every window with it, as llama.cpp's perplexity does: then
    every text token is predicted, the first one included."""
    ids = tokenizer("\n\n".join(t for t in texts if t.strip()), return_tensors="pt")["input_ids"][0]
    bos = _leading_bos(tokenizer)
    if bos is not None:
        ids = ids[1:]
    body = max_length - (bos is not None)  # text tokens in a window
    if body < 1:
        raise DataError(f"a window of {max_length} token holds only the BOS token; give --max-length 2 or more")
    windows, labels = [], []
    previous_end = 0
    for begin in range(0, max(len(ids) - (bos is None), 1), stride or body):
        end = min(begin + body, len(ids))
        window = ids[begin:end]
        target = window.clone()
        target[: max(previous_end - begin, 0)] = -100  # tokens already scored by the previous window
        if bos is not None:
            window, target = torch.cat([bos, window]), torch.cat([torch.tensor([-100]), target])
        windows.append(window)
        labels.append(target)
        previous_end = end
        if end == len(ids):
            break
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = []
    for start in range(0, len(windows), batch_size):
        chunk, targets = windows[start : start + batch_size], labels[start : start + batch_size]
        width = max(len(w) for w in chunk)
        input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        label_ids = torch.full((len(chunk), width), -100, dtype=torch.long)
        for row, (w, t) in enumerate(zip(chunk, targets)):
            input_ids[row, : len(w)], attention[row, : len(w)], label_ids[row, : len(t)] = w, 1, t
        batches.append({"input_ids": input_ids, "attention_mask": attention, "labels": label_ids})
    return TaskData("causal-lm", batches, len(windows), info={"tokens": int(len(ids))})
