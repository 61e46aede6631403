"""One `prune_model` call's record (`Run`), what it returns (`PruneResult`), and the held-out measurements its
steps share: a language model's perplexity on the held-out batches, its rise from the unpruned model's, and a plan
put on the gated model with its refits."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..config import PruneConfig, RecoveryConfig
from ..recovery.candidates import Trial
from ..recovery.depth import Depth
from ..recovery.generated import writes_text
from ..recovery.holdout import SequenceNLL, measures_loss, sequence_nll
from ..recovery.reconstruction import refit_flops
from ..runtime.devices import input_device
from ..scoring.head_scores import HeadScores
from ..scoring.objective import Objective
from ..scoring.selection import HeadBudget

BEFORE_TUNING = ("generation", "recording", "search", "depth", "selection")  # recovery's work before tuning
logger = logging.getLogger("prune_heads")


@dataclass
class PruneResult:
    """What `prune_model` did: the plan (original head indices per layer), the scores it was chosen from,
    the per-step history of iterative pruning, each recovery decision (`recovery`: what was tried, its
    held-out divergence from the unpruned model, what was kept, seconds), the held-out summary, the heads the
    budget asked for (`asked`; `heads_removed` differs only with `selection.round`), the work of each stage
    in counted FLOPs with the tuning's budget (`work`: what limits the flow, never a clock), the seconds
    per stage (informative only) and each depth `selection.depths` asked for measured (`frontier`)."""

    plan: dict[str, list[int]]
    scores: HeadScores | None = None
    history: list[dict] = field(default_factory=list)
    recovery: list[dict] = field(default_factory=list)
    heldout: dict[str, Any] = field(default_factory=dict)
    asked: int | None = None
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    work: dict[str, float] = field(default_factory=dict)
    frontier: list[Depth] = field(default_factory=list)

    @property
    def heads_removed(self) -> int:
        """Heads the plan removed."""
        return sum(len(h) for h in self.plan.values())


@dataclass
class Run:
    """One `prune_model` call: what its steps read (the model, its layers and objective, the budget, the
    recovery as it runs, the batches) and what they report (notes, recovery steps, the held-out summary,
    counted work, seconds per stage)."""

    model: nn.Module
    config: PruneConfig
    recovery: RecoveryConfig
    budget: HeadBudget
    asked: int
    calib: list[dict]
    heldout: list[dict]
    generated: list[dict]
    layers: list
    objective: Objective
    start: float
    progress: bool
    notes: list[str] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    work: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    unpruned: SequenceNLL | None = None  # a language model's on the held-out batches
    depths: list[tuple[float, int]] = field(default_factory=list)  # the frontier's shares and their heads
    second: list[dict] = field(default_factory=list)  # the frontier's second text, batches with labels
    frontier: list[Depth] = field(default_factory=list)
    given: dict[str, list[int]] | None = None  # a plan given whole, in place of scores and search

    def result(self, plan: dict[str, list[int]], scores: HeadScores | None) -> PruneResult:
        """What the run did, once the plan is removed."""
        steps = [{"step": "notes", "notes": self.notes}, *self.steps] if self.notes else self.steps
        timings = {k: round(v, 3) for k, v in self.timings.items()}
        seconds = time.perf_counter() - self.start
        return PruneResult(
            plan,
            scores,
            recovery=steps,
            heldout=self.summary,
            asked=self.asked,
            seconds=seconds,
            timings=timings,
            work=self.work,
            frontier=self.frontier,
        )


def refitted(run: Run, trial: Trial, plan: dict[str, list[int]], work: str) -> None:
    """Put `plan` on the gated model with each pruned layer refitted, the refits counted as `work`."""
    trial.gated.use(plan, refits={name: trial.refit(name, heads) for name, heads in plan.items()})
    run.work[work] = run.work.get(work, 0.0) + refit_flops(run.layers, plan)


def heldout_nll(run: Run, forward: Any, work: str = "perplexity") -> SequenceNLL | None:
    """A language model's next-token NLL per held-out sequence (a classifier's on its labels, under a loss
    bound; None for other tasks), its pass counted as `work`."""
    measured = writes_text(run.model) or run.config.selection.max_loss is not None and measures_loss(run.model)
    if not (run.heldout and measured and all("labels" in b for b in run.heldout)):
        return None
    run.work[work] = run.work.get(work, 0.0) + run.work["heldout_pass"]
    return sequence_nll(forward, run.heldout, input_device(run.model))


def rise(run: Run, forward: Any, work: str = "perplexity") -> float:
    """The held-out perplexity's relative change from the unpruned model's under `forward`, its pass counted
    as `work`."""
    assert run.unpruned is not None
    pruned = heldout_nll(run, forward, work)
    assert pruned is not None  # the same batches as the unpruned model's
    return math.exp(pruned.mean - run.unpruned.mean) - 1
