"""Evaluating a model as a recipe asks: its task metrics and lm-eval tasks, their paired changes, its speed."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..evaluation.confidence import compare as compare_paired
from ..evaluation.lm_eval import lm_eval
from ..evaluation.speed import benchmark
from ..evaluation.task import Evaluation, evaluation
from ..model.layers import find_attention
from ..recipes import Recipe
from ..task_data import TaskData


def heads_kept(model: nn.Module) -> dict[str, int]:
    """Heads present per attention layer."""
    return {layer.name: layer.num_heads for layer in find_attention(model)}


def measure(
    model: nn.Module,
    data: TaskData | None,
    recipe: Recipe,
    reference: torch.Tensor | None = None,
    train: TaskData | None = None,
    tokenizer: Any = None,
    progress: bool = True,
) -> tuple[dict[str, Any], Evaluation | None]:
    """Task metrics and heads of `model` (speed is timed separately, see `measure_speed`) and, with
    `evaluation.lm_eval`, its lm-eval tasks; and the per-example evaluation behind the metrics (None without
    either)."""
    result: dict[str, Any] = {"heads": heads_kept(model)}
    found = (
        evaluation(model, data, recipe.evaluation.metrics, reference=reference, train=train, progress=progress)
        if data is not None
        else None
    )
    harness = recipe.evaluation.lm_eval
    if harness is not None and harness.tasks:
        tasks = lm_eval(
            model,
            tokenizer,
            harness.tasks,
            harness.include,
            harness.limit,
            harness.num_fewshot,
            harness.batch_size,
            recipe.scoring.seed,
        )
        found = (
            tasks
            if found is None
            else Evaluation(
                {**found.metrics, **tasks.metrics},
                {**found.statistics, **tasks.statistics},
                {**found.correct, **tasks.correct},
            )
        )
    if found is not None:
        result["metrics"] = found.metrics
    return result, found


def changes(before: Evaluation | None, after: Evaluation | None, seed: int) -> dict[str, dict]:
    """Each metric's before/after difference on the same examples, with its paired bootstrap interval and,
    for accuracies, McNemar's p-value (`prune_heads.confidence`)."""
    if before is None or after is None:
        return {}
    return {
        name: compare_paired(
            before.statistics[name],
            after.statistics[name],
            seed,
            (before.correct[name], after.correct[name]) if name in after.correct else None,
        )
        for name in after.statistics
        if name in before.statistics
    }


def measure_speed(models: list[nn.Module], recipe: Recipe) -> list[dict[str, Any]]:
    """Speed of the models in one interleaved run, as the recipe's evaluation.speed asks."""
    speed = recipe.evaluation.speed
    if speed is None:
        raise ConfigError("the recipe has no evaluation.speed section to time the models with")
    timed = benchmark(models, speed)
    assert isinstance(timed, list)  # a list in, a list out
    return timed
