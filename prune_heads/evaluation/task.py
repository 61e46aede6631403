"""Task metrics: classification metrics through `evaluate`, perplexity, embedding fidelity and, for embedding
models with labelled data, task accuracy (logistic regression and k-NN on the embeddings, MTEB's protocol).
Each metric keeps the per-example values it is computed from (`Evaluation.statistics`), so a before/after
difference gets a paired interval (`prune_heads.confidence`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import evaluate
import numpy as np
import torch
from torch import nn

from ..errors import PruneHeadsError
from ..runtime.devices import input_device, to_device
from ..runtime.progress import progress_bar
from ..scoring.objective import fit_probe, neighbour_changes, pooled
from ..task_data import TaskData
from .confidence import Statistic, mean_of, min_of, ratio_of

_SHIPPED = Path(__file__).parent / "metrics"
SHIPPED_METRICS = sorted(p.name for p in _SHIPPED.iterdir() if (p / f"{p.name}.py").exists())


class MetricError(PruneHeadsError, ValueError):
    """A metric that is neither shipped nor loadable."""


def load_metric(name: str) -> evaluate.EvaluationModule:
    """An `evaluate` metric: one we ship (works offline), a local module path, or a hub metric by name."""
    if name in SHIPPED_METRICS:
        return evaluate.load(str(_SHIPPED / name))
    try:
        return evaluate.load(name)
    except Exception as error:  # evaluate raises FileNotFoundError, ConnectionError, ImportError, ...
        raise MetricError(
            f"cannot load metric {name!r} ({type(error).__name__}); offline, use one of "
            f"{', '.join(SHIPPED_METRICS)} or a local evaluate module path"
        ) from None


def _device_batches(model: nn.Module, batches: Iterable[dict], desc: str, progress: bool):
    device = input_device(model)
    total = len(batches) if isinstance(batches, Sized) else None
    for batch in progress_bar(batches, desc, total, progress):
        yield to_device(batch, device)


@torch.no_grad()
def predict(model: nn.Module, batches: Iterable[dict], progress: bool = True) -> tuple[list, list]:
    """Argmax predictions (or regression values) and the references, over all batches."""
    model.eval()
    predictions, references = [], []
    for batch in _device_batches(model, batches, "predicting", progress):
        labels = batch.pop("labels")
        logits = model(**batch).logits.float()
        predictions += (logits.squeeze(-1) if logits.shape[-1] == 1 else logits.argmax(-1)).tolist()
        references += labels.tolist()
    return predictions, references


@torch.no_grad()
def window_losses(model: nn.Module, batches: Iterable[dict], progress: bool = True) -> tuple[list[float], list[int]]:
    """Per window (row of a causal-LM batch): the summed next-token NLL and the labelled tokens it covers."""
    model.eval()
    sums, counts = [], []
    for batch in _device_batches(model, batches, "perplexity", progress):
        labels = batch.pop("labels")
        logits = model(**batch).logits.float()[:, :-1]
        targets = labels[:, 1:]
        nll = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="none"
        ).reshape(targets.shape)
        sums += nll.sum(-1).tolist()
        counts += (targets != -100).sum(-1).tolist()
    return sums, counts


def perplexity(model: nn.Module, batches: Iterable[dict], progress: bool = True) -> dict[str, float]:
    """exp of the mean next-token NLL over every labelled token (labels -100 are skipped)."""
    sums, counts = window_losses(model, batches, progress)
    loss = sum(sums) / max(sum(counts), 1)
    return {"perplexity": math.exp(loss), "loss": loss, "tokens": sum(counts)}


@torch.no_grad()
def embed(model: nn.Module, batches: Iterable[dict], progress: bool = True) -> torch.Tensor:
    """Mean-pooled, L2-normalised embeddings [examples, hidden] (float32, on the CPU)."""
    model.eval()
    chunks = []
    for batch in _device_batches(model, batches, "embedding", progress):
        batch.pop("labels", None)
        outputs = model(**batch)
        chunks.append(nn.functional.normalize(pooled(outputs, batch), dim=-1).cpu())
    return torch.cat(chunks)


def fidelity(reference: torch.Tensor, embeddings: torch.Tensor) -> dict[str, float]:
    """How close pruned embeddings stay to the original ones: mean and minimum cosine, and the fraction of
    examples whose nearest neighbour (among the others) is the same under both."""
    return {name: statistic.value() for name, statistic in _fidelity(reference, embeddings).items()}


def _fidelity(reference: torch.Tensor, embeddings: torch.Tensor) -> dict[str, Statistic]:
    cosine = (reference * embeddings).sum(-1).double().numpy()
    return {
        "cosine": mean_of(cosine),
        "cosine_min": min_of(cosine),
        "nn_agreement": mean_of(1 - neighbour_changes(reference, embeddings).numpy()),
    }


NEIGHBOURS = 5  # k of the k-NN classifier


def logistic_regression(
    train: torch.Tensor, labels: torch.Tensor, test: torch.Tensor, steps: int = 100
) -> torch.Tensor:
    """The classes a multinomial logistic regression trained on (`train`, `labels`) predicts for `test`
    (`fit_probe`: scikit-learn's default objective, MTEB's classifier)."""
    return fit_probe(train, labels, steps)(test.double()).argmax(-1)


def nearest_vote(train: torch.Tensor, labels: torch.Tensor, test: torch.Tensor, k: int = NEIGHBOURS) -> torch.Tensor:
    """k-NN classes of `test` rows among the (unit-length) `train` rows by cosine: the most frequent label of
    the k nearest, a tie going to the label of higher summed similarity."""
    similarity, index = (test.double() @ train.double().T).topk(min(k, len(train)), dim=-1)
    votes = nn.functional.one_hot(labels.long()[index], int(labels.max()) + 1).double()
    return (votes.sum(1) + 1e-6 * (votes * similarity.unsqueeze(-1)).sum(1)).argmax(-1)


@dataclass
class Evaluation:
    """A model's metrics on one evaluation set, with the per-example statistics each is computed from
    (`statistics`: metric -> function of example indices) and, for accuracies, which examples it got right
    (`correct`): what a paired before/after comparison needs."""

    metrics: dict[str, Any]
    statistics: dict[str, Statistic] = field(default_factory=dict)
    correct: dict[str, np.ndarray] = field(default_factory=dict)


def _resampled(module: Any, kwargs: dict, key: str, predictions: np.ndarray, references: np.ndarray) -> Callable:
    """The metric `key` of `module` on a resample of the examples (index -> value), through the module's own
    computation (`compute()` converts through datasets: slow)."""
    return lambda index: module._compute(predictions=predictions[index], references=references[index], **kwargs)[key]


def evaluation(
    model: nn.Module,
    data: TaskData,
    metrics: Iterable[str] = ("accuracy",),
    reference: torch.Tensor | None = None,
    metric_args: dict[str, dict] | None = None,
    train: TaskData | None = None,
    progress: bool = True,
) -> Evaluation:
    """The task metrics of `model` on `data`, with their per-example statistics (see `evaluate_task`)."""
    if data.task == "causal-lm":
        sums, counts = window_losses(model, data, progress)
        statistics = {"perplexity": ratio_of(sums, counts, math.exp), "loss": ratio_of(sums, counts)}
        metrics = {name: s.value() for name, s in statistics.items()} | {"tokens": sum(counts)}
        return Evaluation(metrics, statistics)
    if data.task == "feature-extraction":
        embeddings = embed(model, data, progress)
        result = Evaluation({}, _fidelity(embeddings if reference is None else reference, embeddings))
        if data.targets is not None and train is not None and train.targets is not None:
            known, labels = embed(model, train, progress), torch.tensor(train.targets)
            for name, classify in (("logreg_accuracy", logistic_regression), ("knn_accuracy", nearest_vote)):
                result.correct[name] = (classify(known, labels, embeddings) == torch.tensor(data.targets)).numpy()
                result.statistics[name] = mean_of(result.correct[name])
        result.metrics = {name: s.value() for name, s in result.statistics.items()}
        return result
    predictions, references = predict(model, data, progress)
    p, r = np.asarray(predictions), np.asarray(references)
    result = Evaluation({"examples": len(references)})
    for name in metrics:
        module, kwargs = load_metric(name), (metric_args or {}).get(name, {})
        for key, value in module.compute(predictions=predictions, references=references, **kwargs).items():
            result.metrics[key] = value
            result.statistics[key] = Statistic(_resampled(module, kwargs, key, p, r), len(references))
    if "accuracy" in result.statistics:
        result.correct["accuracy"] = p == r
    return result


def evaluate_task(
    model: nn.Module,
    data: TaskData,
    metrics: Iterable[str] = ("accuracy",),
    reference: torch.Tensor | None = None,
    metric_args: dict[str, dict] | None = None,
    train: TaskData | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """The task metric of `model` on `data`.

    Classification and image classification: each metric in `metrics` through `evaluate` (with optional
    keyword arguments per metric in `metric_args`, e.g. {"f1": {"average": "macro"}}). Causal LM:
    perplexity. Feature extraction: fidelity to the `reference` embeddings (those of the unpruned model;
    without one, the model is its own reference) and, when `data` and `train` carry labels
    (`TaskData.targets`), the accuracy of a logistic regression and of a k-NN classifier trained on
    `train`'s embeddings and tested on `data`'s (MTEB's protocol).
    """
    return evaluation(model, data, metrics, reference, metric_args, train, progress).metrics
