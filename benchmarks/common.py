"""Shared set-up for the benchmarks: the fixture classifier and its splits (../shared/fixtures)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers.utils import logging

from prune_heads.evaluation.task import evaluate_task, evaluation
from prune_heads.pruner import PruneResult
from prune_heads.task_data import TaskData, load_task_data

FIXTURES = Path(os.environ.get("PH_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures"))
MODEL = FIXTURES / "minilm-movie-sentiment"
DATA = FIXTURES / "movie-snippets"
THIRD = Path(os.environ.get("PH_THIRD", Path(__file__).resolve().parent / ".third"))  # extra_classifiers.py
FIXTURES_BY_NAME = {
    "movie": ("minilm-movie-sentiment", "movie-snippets"),
    "tweet": ("minilm-tweet-sentiment", "tweet-snippets"),
    "product": ("minilm-product-sentiment", "product-snippets"),
    "news": ("minilm-news-sentiment", "news-snippets"),
}
ROOTS = {"product": THIRD, "news": THIRD}  # the others are shared fixtures
logging.set_verbosity_error()
logging.disable_progress_bar()


def fixture() -> tuple[object, TaskData, TaskData]:
    """A fresh copy of the fixture classifier, its validation batches (scoring) and test batches (accuracy)."""
    if not MODEL.exists():
        raise SystemExit(f"the benchmarks need the shared fixture at {MODEL}")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    validation = load_task_data(str(DATA), tokenizer, split="validation", batch_size=64, max_length=128)
    test = load_task_data(str(DATA), tokenizer, split="test", batch_size=64, max_length=128)
    return load_model(), validation, test


def load_model():
    """The unpruned fixture classifier, in eval mode."""
    return AutoModelForSequenceClassification.from_pretrained(MODEL).eval()


def classifier(name: str) -> tuple[object, TaskData, TaskData]:
    """A fresh copy of a fixture classifier ("movie", "tweet", or "product" and "news", which
    benchmarks/extra_classifiers.py builds), its validation and test batches."""
    model_dir, data_dir = (ROOTS.get(name, FIXTURES) / part for part in FIXTURES_BY_NAME[name])
    if not model_dir.exists():
        build = f" (run benchmarks/extra_classifiers.py --name {name})" if name in ROOTS else ""
        raise SystemExit(f"the benchmarks need the classifier at {model_dir}{build}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    validation = load_task_data(str(data_dir), tokenizer, split="validation", batch_size=64, max_length=128)
    test = load_task_data(str(data_dir), tokenizer, split="test", batch_size=64, max_length=128)
    return AutoModelForSequenceClassification.from_pretrained(model_dir).eval(), validation, test


def accuracy(model, test: TaskData) -> float:
    """Test accuracy through the evaluator."""
    return evaluate_task(model, test, ["accuracy"], progress=False)["accuracy"]


def correctness(model, test: TaskData) -> np.ndarray:
    """Which test examples the model gets right (bool per example), through the evaluator."""
    return evaluation(model, test, ["accuracy"], progress=False).correct["accuracy"]


class Timer:
    """with Timer() as t: ...; t.seconds"""

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table; floats get 3 decimals."""

    def cell(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def decisions(result: PruneResult) -> str:
    """What the held-out decisions kept, in a few words."""
    kept = [e for e in result.recovery if e["step"] == "selection"]
    tuning = [e for e in result.recovery if "tuning" in e["step"]]
    words = [kept[0]["kept"]] if kept and kept[0]["tried"]["ranked"] is not None else []
    if tuning and tuning[0].get("kept", True):
        words.append(f"tuned {tuning[0]['epochs_run']} ep")
    return ", ".join(words) or "-"


def seconds_range(seconds: list[float]) -> str:
    """The range of a row's timings, as its last cell: "12-15 s"."""
    return f"{min(seconds):.0f}-{max(seconds):.0f} s"


def sparsity_header(sparsities) -> list[str]:
    """The header of a table with one column per fraction of heads removed and the prune_model time."""
    return ["method", *[f"{s:.0%} removed" for s in sparsities], "prune_model time"]


def verdict(points: dict, allowed: float) -> str:
    """A loss of at most `allowed` points: MET when the whole interval is above -allowed, NOT MET when it is
    below, else within noise (the test set cannot tell)."""
    return "MET" if points["low"] >= -allowed else "NOT MET" if points["high"] < -allowed else "within noise"


def torch_threads() -> int:
    return torch.get_num_threads()


class PeakRSS:
    """The peak resident memory of this process inside the block, above what it held when the block began: the
    kernel's high-water mark (VmHWM), reset on entry (/proc/self/clear_refs), so no short peak is missed."""

    def __enter__(self):
        Path("/proc/self/clear_refs").write_text("5")
        self.start = self._status("VmRSS")
        return self

    def __exit__(self, *exc):
        self.bytes = self._status("VmHWM") - self.start

    @staticmethod
    def _status(key: str) -> int:
        return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def random_batches(vocab_size: int, count: int, size: int, length: int, device: str) -> list[dict]:
    """`count` batches of seeded random token ids (`size` x `length`) on `device`, labelled with themselves."""
    generator = torch.Generator().manual_seed(0)
    found = []
    for _ in range(count):
        ids = torch.randint(3, vocab_size, (size, length), generator=generator).to(device)
        found.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return found
