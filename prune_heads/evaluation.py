"""Task metrics: classification metrics through `evaluate`, perplexity, and embedding fidelity."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import evaluate
import torch
from torch import nn

from .data import TaskData, input_device, progress_bar, to_device
from .objective import neighbour_changes, pooled

_SHIPPED = Path(__file__).parent / "metrics"
SHIPPED_METRICS = sorted(p.name for p in _SHIPPED.iterdir() if (p / f"{p.name}.py").exists())


class MetricError(ValueError):
    """A metric that is neither shipped nor loadable."""


def load_metric(name: str) -> evaluate.EvaluationModule:
    """An `evaluate` metric: one we ship (works offline), a local module path, or a hub metric by name."""
    if name in SHIPPED_METRICS:
        return evaluate.load(str(_SHIPPED / name))
    try:
        return evaluate.load(name)
    except Exception as error:  # evaluate raises FileNotFoundError, ConnectionError, ImportError, ...
        raise MetricError(f"cannot load metric {name!r} ({type(error).__name__}); offline, use one of "
                          f"{', '.join(SHIPPED_METRICS)} or a local evaluate module path") from None


def _device_batches(model: nn.Module, batches: Iterable[dict], desc: str, progress: bool):
    device = input_device(model)
    total = len(batches) if hasattr(batches, "__len__") else None
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
def perplexity(model: nn.Module, batches: Iterable[dict], progress: bool = True) -> dict[str, float]:
    """exp of the mean next-token NLL over every labelled token (labels -100 are skipped)."""
    model.eval()
    total, tokens = 0.0, 0
    for batch in _device_batches(model, batches, "perplexity", progress):
        labels = batch.pop("labels")
        logits = model(**batch).logits.float()[:, :-1]
        targets = labels[:, 1:]
        nll = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                          ignore_index=-100, reduction="sum")
        total += float(nll)
        tokens += int((targets != -100).sum())
    loss = total / max(tokens, 1)
    return {"perplexity": math.exp(loss), "loss": loss, "tokens": tokens}


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
    cosine = (reference * embeddings).sum(-1)
    return {"cosine": float(cosine.mean()), "cosine_min": float(cosine.min()),
            "nn_agreement": float(1 - neighbour_changes(reference, embeddings).mean())}


def evaluate_task(model: nn.Module, data: TaskData, metrics: Iterable[str] = ("accuracy",),
                  reference: torch.Tensor | None = None, metric_args: dict[str, dict] | None = None,
                  progress: bool = True) -> dict[str, Any]:
    """The task metric of `model` on `data`.

    Classification and image classification: each metric in `metrics` through `evaluate` (with optional
    keyword arguments per metric in `metric_args`, e.g. {"f1": {"average": "macro"}}). Causal LM:
    perplexity. Feature extraction: fidelity to the `reference` embeddings (those of the unpruned model);
    without a reference, the model is its own reference.
    """
    if data.task == "causal-lm":
        return perplexity(model, data, progress)
    if data.task == "feature-extraction":
        embeddings = embed(model, data, progress)
        return fidelity(embeddings if reference is None else reference, embeddings)
    predictions, references = predict(model, data, progress)
    results: dict[str, Any] = {}
    for name in metrics:
        results.update(load_metric(name).compute(predictions=predictions, references=references,
                                                 **(metric_args or {}).get(name, {})))
    results["examples"] = len(references)
    return results
