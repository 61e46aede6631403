"""One `prune_model` call's records, each frozen once made: the run as it starts (`Run`), the bench every
decision is measured on (`Bench`), what it returns (`PruneResult`), and the held-out measurements the stages
share: a language model's perplexity on the held-out batches, its rise from the unpruned model's, and a plan put
on the gated model with its refits."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..budgets import Budget
from ..config import PruneConfig
from ..model.kv_sharing import written_plan
from ..recovery.candidates import Decision, Trial
from ..recovery.general import General
from ..recovery.generated import writes_text
from ..recovery.heal import HealStart
from ..recovery.holdout import SequenceNLL, measures_loss, sequence_nll
from ..recovery.prefixes import Depth
from ..recovery.reconstruction import refit_flops
from ..runtime.devices import input_device
from ..runtime.ledger import Ledger, Stage, Tally
from ..runtime.work import Pricer
from ..scoring.head_scores import HeadScores
from ..scoring.objective import Objective
from ..scoring.recording import Recorder
from ..scoring.selection import HeadBudget

logger = logging.getLogger("prune_heads")


@dataclass(frozen=True)
class PruneResult:
    """What `prune_model` did: the plan (original head indices per layer), the scores it was chosen from,
    each recovery decision (`recovery`: what was tried, its held-out divergence from the unpruned model, what
    was kept, seconds), the held-out summary, the heads the budget asked for (`asked`; `heads_removed` differs
    only with `selection.round`), the counted work of each stage with the tuning's budget (`work`: what limits
    the flow, never a clock), the seconds per stage (informative only), each depth `selection.depths` asked
    for measured (`frontier`), the KV heads it shares in layers the plan leaves whole (`sharing`: {layer:
    {merged KV head: the one its query heads read}}, under a KV-cache budget) and, from `prune_iteratively`'s
    path, the loss after each step (`history`)."""

    plan: dict[str, list[int]]
    scores: HeadScores | None = None
    history: list[dict] = field(default_factory=list)
    recovery: list[dict] = field(default_factory=list)
    heldout: dict[str, Any] = field(default_factory=dict)
    asked: int | None = None
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    work: Ledger | None = None
    frontier: list[Depth] = field(default_factory=list)
    sharing: dict[str, dict[int, int]] = field(default_factory=dict)

    @property
    def heads_removed(self) -> int:
        """Heads the plan removed."""
        return sum(len(h) for h in self.plan.values())

    @property
    def written_plan(self) -> dict:
        """The plan with the KV heads it shares, as plan.json holds it and `prune_model(plan=...)` and `--plan`
        take it."""
        return written_plan(self.plan, self.sharing)


@dataclass(frozen=True)
class Run:
    """One `prune_model` call as it starts, fixed from then on: the model with its attention layers and
    objective, the config it runs (its recovery less the steps this model cannot hold), the budget resolved
    (with a plan given whole and a frontier's depths), the batches (`scoring`, the calibration part as given,
    what scoring reads; `calib`, the same on the model's device without labels; `heldout`, the held-out part),
    the model's written text beside them, a frontier's second text, the general-ability guard's text (None where
    it is off), the notes made on the way in, where weights are onloaded, the bytes onloading had moved
    before the run and the offloaded weights' bytes, what a heal needs (None without one), the price of passes
    and the work counted on the way in (the written text, the proof of a model run one layer at a time)."""

    model: nn.Module
    config: PruneConfig
    budget: Budget
    scoring: list[dict]
    calib: list[dict]
    heldout: list[dict]
    generated: list[dict]
    layers: list
    objective: Objective
    start: float
    progress: bool
    pricer: Pricer
    second: list[dict] = field(default_factory=list)
    general: General | None = None
    notes: tuple[str, ...] = ()
    moved: int = 0
    offloaded: int = 0
    heal: HealStart | None = None
    work: Mapping[Stage, float] = field(default_factory=dict)

    @property
    def weighs_general(self) -> bool:
        """Whether the decisions weigh the guard's text beside the calibration's (`recovery.general` 'weigh')."""
        return self.general is not None and self.config.recovery.general == "weigh"


@dataclass(frozen=True)
class Bench:
    """What every decision after scoring is measured on: the trial (the gated model, the unpruned model's
    statistics and held-out outputs), the work counted as it is spent and the unpruned
    model's held-out NLL, on the calibration's and on the guard's held-out text (a language model's; None
    otherwise)."""

    trial: Trial
    tally: Tally
    unpruned: SequenceNLL | None = None
    general: SequenceNLL | None = None


@dataclass(frozen=True)
class Scored:
    """What scoring gave: the heads' scores (None for a plan given whole), the unpruned model's statistics on
    the calibration batches (None without recovery), the work counted for each (the recording's where it took
    a pass of its own) and the seconds."""

    scores: HeadScores | None
    recorder: Recorder | None
    work: Mapping[Stage, float]
    seconds: float


@dataclass(frozen=True)
class Chosen:
    """What selection decided: the candidate kept (the gated model left in its state), the budget it was
    chosen at with its heads (a quality bound's depth, where one was asked), the frontier measured, the notes
    and held-out summary it made, and the seconds."""

    decision: Decision
    budget: HeadBudget
    asked: int
    frontier: list[Depth]
    notes: list[str]
    summary: dict[str, Any]
    seconds: float


@dataclass(frozen=True)
class Tuned:
    """What tuning did: the report's step, the held-out divergence it left (None without held-out batches), its
    cap in FLOPs (None without one) and the seconds."""

    entry: dict[str, Any]
    final: float | None
    limit: float | None
    seconds: float


def refitted(run: Run, bench: Bench, plan: dict[str, list[int]], stage: Stage) -> None:
    """Put `plan` on the gated model with each pruned layer refitted, the refits counted for `stage`."""
    trial = bench.trial
    trial.gated.use(plan, refits={name: trial.refit(name, heads) for name, heads in plan.items()})
    bench.tally.add(stage, refit_flops(run.layers, plan))


def heldout_nll(
    run: Run, tally: Tally, forward: Any, stage: Stage = Stage.PERPLEXITY, batches: list | None = None
) -> SequenceNLL | None:
    """A language model's next-token NLL per held-out sequence (a classifier's on its labels, under a loss
    bound; None for other tasks), on `batches` (the held-out calibration batches by default), their pass
    (priced by the run's pricer) counted for `stage`."""
    batches = run.heldout if batches is None else batches
    measured = writes_text(run.model) or run.config.selection.max_loss is not None and measures_loss(run.model)
    if not (batches and measured and all("labels" in b for b in batches)):
        return None
    tally.add(stage, run.pricer.forward(batches))
    return sequence_nll(forward, batches, input_device(run.model))


def rise(run: Run, bench: Bench, forward: Any, stage: Stage = Stage.PERPLEXITY) -> float:
    """The held-out perplexity's relative change from the unpruned model's under `forward`, its pass counted
    for `stage`."""
    assert bench.unpruned is not None
    pruned = heldout_nll(run, bench.tally, forward, stage)
    assert pruned is not None  # the same batches as the unpruned model's
    return math.exp(pruned.mean - bench.unpruned.mean) - 1


def general_rise(run: Run, bench: Bench, forward: Any, stage: Stage = Stage.PERPLEXITY) -> float:
    """The same on the guard's held-out text."""
    assert bench.general is not None and run.general is not None
    pruned = heldout_nll(run, bench.tally, forward, stage, run.general.heldout)
    assert pruned is not None  # the same batches as the unpruned model's
    return math.exp(pruned.mean - bench.general.mean) - 1


def worst_rise(run: Run, bench: Bench, forward: Any, stage: Stage) -> float:
    """The larger of the held-out perplexity's rises: the calibration's and, where the decisions weigh the
    guard's text, its text's."""
    found = rise(run, bench, forward, stage)
    return max(found, general_rise(run, bench, forward, stage)) if run.weighs_general else found
