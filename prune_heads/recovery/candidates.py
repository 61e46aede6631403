"""The candidate states of the pruned model and the held-out choice among them. A candidate is a plan (the plain
ranking, Kwon et al.'s Fisher-block rearrangement, FLAP's fluctuation, structured OBS, the searched plan) with
the recovery step that goes with it (its closed-form reconstruction, or bias compensation); each is tried on
the gated model against the unpruned model's outputs on held-out calibration batches, and the first within
one standard error of the best is kept (`holdout.one_standard_error`)."""

from __future__ import annotations

import collections
import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from ..model.kv_sharing import KeyMaps
from ..model.onload import passes
from ..model.surgery import PlanError
from ..runtime.memory import release_freed_memory
from ..runtime.parallel import Shards
from ..runtime.progress import progress_bar
from ..scoring.head_scores import HeadScores
from ..scoring.methods import fluctuation, head_scores
from ..scoring.objective import Objective
from ..scoring.recording import Recorder
from ..scoring.selection import HeadBudget, select_heads
from ..task_data import batch_size
from .gated import GatedModel
from .holdout import balanced, one_standard_error
from .reconstruction import Refit, RemovalCost, refit, refit_flops, shared_refit_flops
from .sharing_statistics import Merges, SharedStatistics, reading, repointed

Plan = dict[str, list[int]]


def candidate_plans(
    scores: HeadScores,
    recorder: Recorder | None,
    layers: list,
    budget: HeadBudget,
    rearrange: bool,
    reconstruction: bool,
) -> tuple[dict[str, Plan], list[str], float]:
    """The plans to try, by name, a note for each that could not be made and the counted work of making them:
    the plain ranking and, with `rearrange` and the unpruned model's statistics (`recorder`), the Fisher-block
    and FLAP plans and, with `reconstruction`, the structured-OBS plan (what the kept heads can stand in for,
    refitted; its removal costs are the work counted)."""
    plans = {"ranked": select_heads(scores, budget)}
    if recorder is None or not rearrange:
        return plans, [], 0.0
    notes = []
    strategies: dict[str, Any] = {"interactions": "interactions"}
    if reconstruction:
        strategies["OBS"] = RemovalCost(layers, recorder.moments)
    for name, strategy in strategies.items():
        try:
            plans[name] = select_heads(scores, dataclasses.replace(budget, strategy=strategy))
        except PlanError as error:
            notes.append(f"{name} not tried: {error}")
    groups = budget.gqa == "groups"
    fluct = head_scores("fluctuation", layers, fluctuation(layers, recorder.variances(), groups), scores.num_examples)
    plans["fluctuation"] = select_heads(fluct, budget)
    return plans, notes, strategies["OBS"].flops if reconstruction else 0.0


class Step(Enum):
    """The recovery step a candidate plan is tried with; its value is how the report names it."""

    NONE = ""
    RECONSTRUCTION = "reconstruction"
    BIAS_COMPENSATION = "bias compensation"


@dataclass(frozen=True)
class Candidate:
    """A plan (`name` says which) and the recovery step tried with it; with `sharing`, the KV heads it merges in
    layers the plan leaves whole, refitted from `statistics`, those recorded for it
    (`prune_heads.recovery.sharing_statistics`)."""

    name: str
    plan: Plan
    step: Step = Step.NONE
    sharing: dict[str, Merges] = field(default_factory=dict)
    statistics: SharedStatistics | None = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        """How the report names it: "OBS + reconstruction"."""
        return f"{self.name} + {self.step.value}" if self.step is not Step.NONE else self.name


def candidates(
    plans: dict[str, Plan], reconstruction: bool, bias_compensation: bool, recorded: bool
) -> list[Candidate]:
    """The candidates in order of preference: the first plan (the plain ranking, or a plan given whole) as it
    is, then each plan with its reconstruction (or bias compensation, or as it is where neither is on); the
    steps need the unpruned model's statistics (`recorded`)."""
    found = []
    for i, (name, plan) in enumerate(plans.items()):
        if i == 0 or not reconstruction:
            found.append(Candidate(name, plan))
        if recorded and reconstruction:
            found.append(Candidate(name, plan, Step.RECONSTRUCTION))
        elif recorded and bias_compensation:
            found.append(Candidate(name, plan, Step.BIAS_COMPENSATION))
    return found


def fallback(plans: dict[str, Plan], reconstruction: bool, bias_compensation: bool) -> str:
    """The label kept where there is no held-out data to choose on: every enabled step, as configured."""
    name = "OBS" if "OBS" in plans else "interactions" if "interactions" in plans else next(iter(plans))
    step = Step.RECONSTRUCTION if reconstruction else Step.BIAS_COMPENSATION if bias_compensation else Step.NONE
    return Candidate(name, {}, step).label


@dataclass(frozen=True)
class State:
    """A state of the gated model: the plan, the added biases or the reconstruction with it, the KV heads it
    shares with their key maps, the counted work of the refits made for it (for the stage that asked for it to
    count) and a note for each refit that fell back to bias compensation."""

    plan: Plan
    biases: dict[str, torch.Tensor] | None = None
    refits: dict[str, Refit] | None = None
    sharing: dict[str, Merges] = field(default_factory=dict)
    maps: dict[str, KeyMaps] = field(default_factory=dict)
    work: float = 0.0
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Trial:
    """What candidates are tried with: the gated model, the objective, the unpruned model's statistics on the
    calibration batches (`calibration`, None without recovery) and on the held-out ones (`reference`, None
    without held-out data), those held-out batches (the calibration's, then the general-ability guard's:
    `domain` says how many examples are the calibration's; `prune_heads.recovery.general`), whether a refit
    fits an output bias (`bias`) and whether the search and the choice show progress bars (`progress`)."""

    gated: GatedModel
    objective: Objective
    calibration: Recorder | None
    reference: Recorder | None
    batches: list[dict]
    bias: bool
    progress: bool = False
    domain: int | None = None

    @property
    def targets(self) -> list:
        """The unpruned model's outputs on the held-out batches."""
        return self.reference.targets if self.reference is not None else []

    def refit(self, name: str, heads: tuple[int, ...] | list[int]) -> Refit:
        """Layer `name`'s reconstruction without `heads`, fitted against the unpruned weights."""
        assert self.calibration is not None
        self.gated.restore()  # not to a candidate's refit written into the weights
        i = self.gated.index[name]
        held = self.reference.moments[i] if self.reference is not None else None
        return refit(self.gated.layers[i], heads, self.calibration.moments[i], held, self.bias)

    def shared_refit(self, name: str, shared: SharedStatistics) -> Refit:
        """Layer `name`'s reconstruction with the KV heads the recorded sharing `shared` merges there."""
        self.gated.restore()
        layer, merges = self.gated.layers[self.gated.index[name]], shared.merges[name]
        held = shared.heldout.get(name)
        recorded = [repointed(layer, merges)]
        return refit(layer, (), shared.calibration[name], held, self.bias, reading(layer, merges), recorded)

    def better_shared(self, plan: Plan, shared: SharedStatistics) -> tuple[dict[str, Merges], float]:
        """The layers of the recorded sharing `shared` whose refit fits better shared than with `plan`'s heads
        removed (the held-out relative error), and the refits' work, for the caller to count under its own
        stage."""
        merges = shared.merges
        work = refit_flops(self.gated.layers, {n: plan[n] for n in merges})
        work += shared_refit_flops(self.gated.layers, merges)
        better = {n: m for n, m in merges.items() if self.shared_refit(n, shared).error < self.refit(n, plan[n]).error}
        return better, work

    def state(self, candidate: Candidate) -> State:
        """The candidate's state: its plan with its reconstruction (its work and the notes of any refit that fell
        back) or bias compensation, and its sharing with the key maps recorded for it."""
        plan, sharing = candidate.plan, candidate.sharing
        maps = _maps(candidate)
        if candidate.step == Step.RECONSTRUCTION:
            refits = {**self._refits(plan), **self._shared_refits(candidate)}
            work = refit_flops(self.gated.layers, plan) + shared_refit_flops(self.gated.layers, sharing)
            return State(plan, refits=refits, sharing=sharing, maps=maps, work=work, notes=fell_back(refits))
        if candidate.step == Step.BIAS_COMPENSATION:
            assert self.calibration is not None
            biases = self.gated.compensation(plan, self.calibration.means())
            return State(plan, biases=biases, sharing=sharing, maps=maps)
        return State(plan, sharing=sharing, maps=maps)

    def _refits(self, plan: Plan) -> dict[str, Refit]:
        return {l.name: self.refit(l.name, plan[l.name]) for l in self.gated.layers if plan.get(l.name)}

    def _shared_refits(self, candidate: Candidate) -> dict[str, Refit]:
        if not candidate.sharing:
            return {}
        assert candidate.statistics is not None  # recorded wherever a reconstruction shares
        return {name: self.shared_refit(name, candidate.statistics) for name in candidate.sharing}

    def use(self, state: State) -> None:
        """Put the gated model in `state`."""
        self.gated.use(state.plan, state.biases, state.refits, state.sharing, state.maps)

    def measure(self, state: State) -> torch.Tensor | None:
        """The per-example held-out divergences of the gated model put in `state` (None without held-out data)."""
        self.use(state)
        return self.divergences() if self.batches else None

    def divergences(self) -> torch.Tensor:
        """The per-example held-out divergences of the gated model as it is, the two sets weighted equally
        (`holdout.balanced`) where a guard's text follows the calibration's."""
        values = self.gated.divergences(self.batches, self.targets, self.objective)
        return values if self.domain is None else balanced(values, self.domain)

    def release(self) -> None:
        """Drop the held-out Gram matrices once every reconstruction is made (the outputs stay)."""
        if self.reference is not None:
            self.reference.release_moments()


def _maps(candidate: Candidate) -> dict[str, KeyMaps]:
    """The key maps of the candidate's sharing, from the statistics recorded for it (none where it shares
    nothing, or its keys are read as they are: a sharing given whole without recovery)."""
    if not candidate.sharing or candidate.statistics is None:
        return {}
    return {name: candidate.statistics.maps[name] for name in candidate.sharing if name in candidate.statistics.maps}


def fell_back(refits: dict[str, Refit]) -> tuple[str, ...]:
    """A note for each refit that fell back to bias compensation, and why."""
    return tuple(
        f"{name}: reconstruction fell back to bias compensation: {r.fallback}"
        for name, r in refits.items()
        if r.fallback is not None
    )


@dataclass(frozen=True)
class Decision:
    """The candidate kept (`label`: the gated model is left in its state, whose `plan` it removes), its
    held-out values, every candidate's mean held-out value, what its reconstruction chose (None without
    one), the KV heads it shares, the counted work of the refits made to choose it and the notes of its refits
    that fell back. It keeps no refit: their fits are in the weights, the originals in the gated model."""

    label: str
    plan: Plan
    values: torch.Tensor | None
    tried: dict[str, float | None]
    reconstruction: dict[str, Any] | None
    sharing: dict[str, Merges] = field(default_factory=dict)
    work: float = 0.0
    notes: tuple[str, ...] = ()

    @property
    def value(self) -> float | None:
        """The kept state's mean held-out divergence."""
        return None if self.values is None else float(self.values.mean())

    def entry(self, seconds: float) -> dict[str, Any]:
        """The report's "selection" step, which took `seconds`."""
        found: dict[str, Any] = {"step": "selection", "kept": self.label, "seconds": seconds, "tried": self.tried}
        if self.reconstruction is not None:
            found["reconstruction"] = self.reconstruction
        if self.sharing:
            found["shared_kv_heads"] = {name: dict(merges) for name, merges in self.sharing.items()}
        return found


def choose(trial: Trial, tried: list[Candidate], otherwise: str) -> Decision:
    """Try each candidate on the held-out batches and keep the first within one standard error of the best
    (`otherwise`, the label to keep, without held-out batches); the gated model is left in its state. A
    reconstruction tried is made again once kept (each is a share of the weights: not kept meanwhile).
    A bar over the candidates where the trial shows progress."""
    measured: dict[str, tuple[torch.Tensor | None, Candidate, State]] = {}
    work = 0.0
    for candidate in progress_bar(tried, "candidates", len(tried), trial.progress):
        state = trial.state(candidate)
        work += state.work
        light = dataclasses.replace(state, refits=None)  # the refits made again once kept
        measured[candidate.label] = (trial.measure(state), candidate, light)
    values = {label: v for label, (v, _, _) in measured.items() if v is not None}
    label = one_standard_error(values) if trial.batches else otherwise
    kept, candidate, state = measured[label]
    if candidate.step == Step.RECONSTRUCTION:
        state = trial.state(candidate)
        work += state.work
    trial.use(state)
    means = {k: None if v is None else float(v.mean()) for k, (v, _, _) in measured.items()}
    summary = _summary(state.refits) if state.refits else None
    return Decision(label, state.plan, kept, means, summary, state.sharing, work, state.notes)


def _summary(refits: dict[str, Refit]) -> dict[str, Any]:
    """What a candidate's reconstruction chose, for the report: the ridges and the mean relative error."""
    ridges = collections.Counter(
        "bias compensation" if math.isinf(r.ridge) else f"{r.ridge:g}" for r in refits.values()
    )
    return {
        "layers": len(refits),
        "ridges": dict(ridges),
        "relative_error": sum(r.error for r in refits.values()) / max(len(refits), 1),
    }


@torch.no_grad()
def unpruned_heldout(gated: GatedModel, heldout: list[dict], objective: Objective, gram: bool) -> Recorder:
    """The unpruned model's outputs on the held-out batches (what every candidate is compared with) and, with
    `gram`, the Gram matrices there (what chooses each reconstruction's ridge)."""
    shards = Shards(heldout)  # data-parallel: this process's rows, the statistics summed
    with Recorder(gated.model, gated.layers, objective, gram=gram) as recorder:
        gated.use({})
        for _ in passes(gated.model, shards.local, gated):
            release_freed_memory()
    recorder.gather(shards)
    return recorder


def heldout_summary(decision: Decision, batches: list[dict]) -> dict[str, Any]:
    """The report's held-out summary after the choice (`final` changes if tuning is kept)."""
    return {
        "batches": len(batches),
        "examples": sum(batch_size(b) for b in batches),
        "plain": next(iter(decision.tried.values())),  # the first plan as it is
        "selected": decision.value,
        "final": decision.value,
    }
