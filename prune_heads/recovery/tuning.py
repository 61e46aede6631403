"""Tuning after removal: Adam over head scales and output biases against the unpruned outputs (KL on logits,
1 - cosine of pooled embeddings), stopping when a held-out check (of the last step and of the moving average of
the steps, the lower counting) stops improving, within a budget of counted work; `tune_gates` is its form for
a pruned model and a separate unpruned reference."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from ..config import AVERAGE
from ..model.gates import fold_gates, head_gates
from ..model.layers import find_attention, resolve
from ..runtime.devices import input_device, on_device_of, to_device
from ..runtime.memory import release_freed_memory
from ..runtime.parallel import Shards, sum_gradients
from ..runtime.work import WorkLimit
from ..scoring.objective import Objective, frozen
from ..task_data import batch_size, without_labels

PATIENCE = 2  # epochs without a better held-out value before tuning stops


def _copy(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of the parameters' current values."""
    return [p.detach().clone() for p in params]


@torch.no_grad()
def _load(params: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Put `values` into the parameters, in place."""
    for p, value in zip(params, values):
        p.copy_(value)


class _Average:
    """An exponential moving average of parameters over optimizer steps (Polyak averaging), bias-corrected
    so the first steps are not pulled towards zero: `values()` is the average, `applied()` puts it in the
    parameters' place for a while (to check it), `reset()` starts a new average from the next step."""

    def __init__(self, params: list[torch.Tensor], decay: float) -> None:
        self.params, self.decay = params, decay
        self.reset()

    def reset(self) -> None:
        self.sums = [torch.zeros_like(p) for p in self.params]
        self.weight = 0.0

    @torch.no_grad()
    def update(self) -> None:
        for total, p in zip(self.sums, self.params):
            total.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)
        self.weight = self.weight * self.decay + 1 - self.decay

    def values(self) -> list[torch.Tensor]:
        """The average so far (call only after a step: `weight` > 0)."""
        return [total / self.weight for total in self.sums]

    @contextmanager
    def applied(self) -> Iterator[None]:
        live = _copy(self.params)
        _load(self.params, self.values())
        try:
            yield
        finally:
            _load(self.params, live)


class Tuning(NamedTuple):
    """What `tune` did: the checked held-out values (the first before tuning), the steps taken, whether the
    parameters it left are the moving average of the steps (else the steps' own values), and the FLOPs it
    spent (0 without a budget to count them)."""

    history: list[float]
    steps: int
    averaged: bool
    flops: float = 0.0


def _readouts(check: Callable[[], float], params: list[torch.Tensor], averaged: _Average | None):
    """The held-out value and a copy of the parameters that give it, for the current parameters and (when
    averaging) their moving average, whichever checks lower; and whether that is the average."""
    options = [(check(), _copy(params), False)]
    if averaged is not None and averaged.weight:
        with averaged.applied():
            options.append((check(), averaged.values(), True))
    return min(options, key=lambda option: option[0])


@dataclass(frozen=True)
class Schedule:
    """How tuning steps: `epochs` passes over the batches in an order seeded by `seed`, and `average`, the
    decay per step of the parameters' moving average kept beside them (0: none)."""

    epochs: int
    seed: int = 0
    average: float = 0.0


def tune(
    forward: Callable[[dict], object],
    groups: list[dict],
    batches: list[dict],
    targets: list,
    objective: Objective,
    schedule: Schedule,
    check: Callable[[], float] | None = None,
    budget: WorkLimit | None = None,
) -> Tuning:
    """Adam over the parameter `groups` so `forward`'s outputs match the targets (the objective's divergence),
    as the schedule says. The moving average (`schedule.average` in (0, 1)) smooths out Adam's step-to-step
    jitter. With `check` (a held-out divergence), it runs after every epoch, on the parameters and on their
    average, and the lower of the two counts: an epoch that does not improve on the best so far goes back
    to the best parameters and halves the learning rates, tuning stops after PATIENCE such epochs, and the
    best parameters are kept. Without `check`, the average (when kept) is what tuning leaves. With `budget`
    (counted FLOPs, never a clock), no step starts whose work and the final check's would pass its limit
    (the first step always runs); a cut epoch is checked like a whole one."""
    run = _Tuner(forward, groups, objective, schedule, check, budget)
    generator = torch.Generator().manual_seed(schedule.seed)
    for _ in range(schedule.epochs):
        order = torch.randperm(len(batches), generator=generator).tolist()
        taken = run.epoch([batches[i] for i in order], [targets[i] for i in order])
        if run.out_of_budget and not taken:  # nothing new to check
            break
        improved = run.checked()
        if run.out_of_budget or (check and not improved and not run.slow_down()):
            break
    return run.finish()


class _Tuner:
    """One `tune` run: the optimizer, the moving average, the best parameters checked so far and the work."""

    def __init__(
        self,
        forward: Callable[[dict], object],
        groups: list[dict],
        objective: Objective,
        schedule: Schedule,
        check: Callable[[], float] | None,
        budget: WorkLimit | None,
    ) -> None:
        self.forward, self.objective, self.check, self.budget = forward, objective, check, budget
        self.params = [p for group in groups for p in group["params"]]
        self.optimizer = torch.optim.Adam(groups)
        self.averaged = _Average(self.params, schedule.average) if schedule.average else None
        self.history = [check()] if check else []
        self.checks = (2 if self.averaged else 1) if check else 0  # held-out passes per check after a step
        if budget is not None and check:
            budget.spent += budget.check
        self.best, self.best_averaged = _copy(self.params), False
        self.misses, self.steps, self.out_of_budget = 0, 0, False

    def epoch(self, batches: list[dict], targets: list) -> int:
        """Steps over the batches in this order until the budget stops them; the number taken."""
        begun = self.steps
        for batch, target in zip(batches, targets):
            cost = self.budget.step(batch) if self.budget is not None else 0.0
            if (
                self.budget is not None
                and self.steps
                and not self.budget.allows(cost + self.checks * self.budget.check)
            ):
                self.out_of_budget = True
                break
            self._step(batch, target)
            if self.budget is not None:
                self.budget.spent += cost
        return self.steps - begun

    def _step(self, batch: dict, target: object) -> None:
        """One Adam step on the batch's mean divergence (data-parallel: each process's rows' share of it, the
        gradients summed)."""
        shards = Shards([batch])
        self.optimizer.zero_grad()
        for local in shards.local:  # none where this process holds no rows of the batch
            divergence = self.objective.divergence(self.forward(local), local, on_device_of(target, local))
            (divergence.sum() / batch_size(batch)).backward()
        sum_gradients(self.params)
        self.optimizer.step()
        release_freed_memory()
        if self.averaged:
            self.averaged.update()
        self.steps += 1

    def checked(self) -> bool:
        """Whether the held-out check (when there is one) improved on the best; the best is kept."""
        if not self.check:
            return False
        value, values, from_average = _readouts(self.check, self.params, self.averaged)
        if self.budget is not None:
            self.budget.spent += self.checks * self.budget.check
        self.history.append(value)
        improved = value < min(self.history[:-1])
        if improved:
            self.best, self.best_averaged = values, from_average
        return improved

    def slow_down(self) -> bool:
        """After an epoch that did not improve: back to the best parameters with halved learning rates, or
        False when PATIENCE such epochs have passed."""
        self.misses += 1
        if self.misses >= PATIENCE:
            return False
        _load(self.params, self.best)
        if self.averaged:
            self.averaged.reset()
        for group in self.optimizer.param_groups:
            group["lr"] /= 2
        return True

    def finish(self) -> Tuning:
        """The best parameters (or, unchecked, the average) in place, and what the run did."""
        if not self.check and self.averaged and self.averaged.weight:
            self.best, self.best_averaged = self.averaged.values(), True
        if self.check or self.best_averaged:
            _load(self.params, self.best)
        self.optimizer.zero_grad(set_to_none=True)
        spent = self.budget.spent if self.budget is not None else 0.0
        return Tuning(self.history, self.steps, self.best_averaged, spent)


def tune_gates(
    model: nn.Module,
    reference: nn.Module,
    dataloader: Iterable[dict],
    epochs: int = 2,
    lr: float = 0.05,
    seed: int = 0,
    bias_lr: float | None = None,
    average: float = AVERAGE,
) -> dict[str, list[float]]:
    """Tune one scale per kept head of a pruned `model` so its outputs match the unpruned `reference`
    model's, then fold the scales into the output projections (the model stays a plain smaller model).

    The objective is the label-free divergence (KL on logits, 1 - cosine of pooled embeddings) over the
    calibration batches, minimised with Adam over the head gates alone. With `bias_lr`, the output
    projections' biases (where they have one) are tuned too, at that learning rate (a learned bias
    compensation). `average` is the decay of the moving average of the tuned values that is kept (0: the
    last step's). `ph.prune_model` does the same on the gated unpruned model, with no second copy.
    Returns the scales per layer.
    """
    device = input_device(model)
    batches = [to_device(without_labels(b), device) for b in dataloader]
    objective = Objective(model)
    reference.eval()
    with torch.no_grad():
        shards = Shards(batches)  # data-parallel: the rows a step runs
        targets = shards.spread([objective.reference(reference(**b), b) for b in shards.local])
    layers = find_attention(model)
    biases = [b for b in (resolve(l.module, l.spec.o).bias for l in layers) if b is not None] if bias_lr else []
    with frozen(model), head_gates(model) as gates:  # frozen restores every requires_grad flag on exit
        for b in biases:
            b.requires_grad_(True)
        groups = [{"params": list(gates), "lr": lr}] + ([{"params": biases, "lr": bias_lr}] if biases else [])
        tune(lambda b: model(**b), groups, batches, targets, objective, Schedule(epochs, seed, average))
        scales = _copy(gates)
    with torch.no_grad():
        for layer, scale in zip(layers, scales):
            if layer.num_heads:
                fold_gates(layer, scale)
    return {layer.name: scale.tolist() for layer, scale in zip(layers, scales)}
