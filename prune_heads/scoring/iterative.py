"""Iterative pruning (Michel et al. 2019): score, remove a slice of heads, re-score, repeat."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import DEFAULT_METHOD
from ..errors import ConfigError
from ..model.probe import prune
from ..runtime.devices import input_device, to_device
from ..task_data import batch_size
from .head_scores import HeadScores
from .methods import score_heads
from .objective import Loss, Objective, frozen
from .selection import HeadBudget, select_heads


@dataclass
class IterativeResult:
    """What `prune_iteratively` removed, and the loss and metric after every step (step 0 = before)."""

    plan: dict[str, list[int]]
    history: list[dict] = field(default_factory=list)
    scores: HeadScores | None = None


def mean_loss(model: nn.Module, dataloader: Iterable[dict], loss: Loss | None = None) -> float | None:
    """Mean per-example task loss over the batches (None when the batches have no labels)."""
    objective = Objective(model, loss)
    device = input_device(model)
    total, count = 0.0, 0
    generator = torch.Generator().manual_seed(0)
    with frozen(model), torch.no_grad():
        for batch in dataloader:
            if "labels" not in batch and loss is None:
                return None
            batch = to_device(batch, device)
            total += float(objective.per_example(model(**batch), batch, generator).double().sum())
            count += batch_size(batch) if loss is None else 1
    return total / max(count, 1)


def prune_iteratively(
    model: nn.Module,
    dataloader: Iterable[dict],
    budget: HeadBudget | float,
    steps: int = 5,
    method: str = DEFAULT_METHOD,
    loss: Loss | None = None,
    evaluate: Callable[[nn.Module], dict] | None = None,
    seed: int = 0,
    progress: bool = True,
) -> IterativeResult:
    """Reach the budget's sparsity (a float: that sparsity under the default constraints) in `steps` equal
    steps, re-scoring the remaining heads before each one.

    After every step the mean loss on `dataloader` and `evaluate(model)` (any dict of metrics, optional)
    are recorded in `history`, so the metric-versus-heads-removed curve can be drawn. Prunes `model` in place.
    """
    if steps < 1:
        raise ConfigError("steps must be at least 1")
    budget = budget if isinstance(budget, HeadBudget) else HeadBudget(sparsity=budget)
    if budget.sparsity is None:
        raise ConfigError("iterative pruning reaches a sparsity: give the budget as one")
    result = IterativeResult(plan={})

    def record(step: int, removed: int) -> None:
        entry = {"step": step, "heads_removed": removed, "loss": mean_loss(model, dataloader, loss)}
        if evaluate is not None:
            entry.update(evaluate(model))
        result.history.append(entry)

    record(0, 0)
    for step in range(1, steps + 1):
        scores = score_heads(model, dataloader, method=method, loss=loss, seed=seed + step, progress=progress)
        plan = select_heads(scores, dataclasses.replace(budget, sparsity=budget.sparsity * step / steps))
        prune(model, plan)
        for name, heads in plan.items():
            result.plan[name] = sorted(result.plan.get(name, []) + heads)
        result.scores = scores
        record(step, sum(len(h) for h in result.plan.values()))
    return result
