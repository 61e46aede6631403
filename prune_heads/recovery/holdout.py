"""Held-out decisions: which calibration examples are held out, and Breiman's one-standard-error rule that
every recovery step is kept by (not on noise)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..runtime.devices import to_device
from ..runtime.parallel import Shards
from ..task_data import TASK_HEADS, batch_size, without_labels
from .generated import writes_text


def split_holdout(batches: list[dict], fraction: float) -> tuple[list[dict], list[dict]]:
    """(calibration, held-out) batches: every 1/fraction-th example across all batches is held out (a slice
    of its own batch, so no padding changes), so the held-out part spans the data the way batches of
    similar lengths do not. No hold-out for fraction 0 or fewer than two examples."""
    total = sum(batch_size(b) for b in batches)
    if fraction <= 0 or total < 2:
        return batches, []
    calib: list[dict] = []
    held: list[dict] = []
    seen = 0
    for batch in batches:
        rows = batch_size(batch)
        out = [r for r in range(rows) if math.floor((seen + r + 1) * fraction) > math.floor((seen + r) * fraction)]
        seen += rows
        keep = [r for r in range(rows) if r not in set(out)]
        for part, index in ((calib, keep), (held, out)):
            if index:
                part.append(_take_rows(batch, torch.tensor(index), rows))
    if not held or not calib:
        return batches, []
    return calib, held


def _take_rows(batch: dict, index: torch.Tensor, rows: int) -> dict:
    """The batch restricted to the rows in `index` (tensors whose first dimension is the batch)."""
    return {
        k: v.index_select(0, index.to(v.device)) if torch.is_tensor(v) and v.dim() and v.shape[0] == rows else v
        for k, v in batch.items()
    }


def one_standard_error(values: dict[str, torch.Tensor]) -> str:
    """The first candidate (in the dict's order of preference) whose mean per-example value is within one
    standard error of the best one's; the error is that of the paired per-example differences, so a choice
    is not made on noise (Breiman's one-standard-error rule)."""
    best = min(values, key=lambda k: float(values[k].mean()))
    for name, v in values.items():
        difference = v - values[best]
        error = float(difference.std() / len(difference) ** 0.5) if len(difference) > 1 else 0.0
        if float(difference.mean()) <= error:
            return name
    return best


def set_weights(domain: int, general: int) -> tuple[float, float]:
    """Each example's weight where `domain` calibration examples and `general` of a second set are measured
    together, so each set counts the same whatever its size: (the calibration's, the second set's)."""
    total = domain + general
    return total / (2 * domain), total / (2 * general)


def balanced(values: torch.Tensor, domain: int) -> torch.Tensor:
    """Per-example `values` of `domain` calibration examples then a second set's, weighted (`set_weights`) so
    their mean is the mean of the two sets' means."""
    general = len(values) - domain
    if not (domain and general):
        return values
    first, second = set_weights(domain, general)
    weights = torch.full_like(values, first)
    weights[domain:] = second
    return values * weights


@dataclass(frozen=True)
class SequenceNLL:
    """Each held-out sequence's summed next-token negative log-likelihood and its labelled tokens (for a
    classifier, each example's class: one labelled token): their ratio is the mean NLL (its exp the perplexity),
    and per sequence they give a paired interval."""

    nll: np.ndarray
    tokens: np.ndarray

    @property
    def mean(self) -> float:
        return float(self.nll.sum() / self.tokens.sum())


def measures_loss(model: Any) -> bool:
    """Whether a held-out loss on labels measures `model`: a decoder-only language model's next tokens, or a
    single-label sequence classifier's classes (not a regression or a multi-label head)."""
    config = model.config
    classifier = type(model).__name__.endswith(TASK_HEADS["classification"]) and config.num_labels > 1
    single = getattr(config, "problem_type", None) in (None, "single_label_classification")
    return writes_text(model) or classifier and single


@torch.no_grad()
def sequence_nll(forward: Callable[[dict], Any], batches: list[dict], device: torch.device) -> SequenceNLL | None:
    """Every labelled next token's negative log-likelihood of `batches` (labels as transformers' causal language
    models take them, shifted inside; class labels, one per example, as its one token), from `forward(batch)`'s
    logits, summed per sequence. None where the batches hold no labels or no labelled token."""
    if any("labels" not in batch for batch in batches):
        return None
    sums, counts, shards = [], [], Shards(batches)  # data-parallel: this process's rows, every process's gathered
    for batch in shards.local:
        logits = forward(to_device(without_labels(batch), device)).logits.float()
        labels = batch["labels"].to(logits.device)
        if labels.dim() == 1:  # a class per example
            logits, labels = logits[:, None], labels[:, None]
        else:
            logits, labels = logits[:, :-1], labels[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
        sums.append(nll.double().sum(-1).cpu())
        counts.append((labels != -100).sum(-1).cpu())
    found = SequenceNLL(torch.cat(shards.gathered(sums)).numpy(), torch.cat(shards.gathered(counts)).numpy())
    return found if found.tokens.sum() else None
