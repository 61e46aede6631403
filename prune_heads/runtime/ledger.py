"""The counted work of one pruning run, by stage: a `Tally` the flow's stages add to while it runs, and the
`Ledger` it closes into, which the tuning budget and the report read. Every figure is FLOPs but the bytes
onloading moved."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType


class Stage(Enum):
    """What a counted FLOP was spent on, in the flow's order; each stage's work is counted under its own member
    alone."""

    SCORING = "scoring"
    GENERATION = "generation"
    RECORDING = "recording"
    SEARCH = "search"
    DEPTH = "depth"
    FRONTIER = "frontier"
    SELECTION = "selection"
    RECONSTRUCTION = "reconstruction"
    TUNING = "tuning"
    HEALING = "healing"
    PERPLEXITY = "perplexity"

    @property
    def label(self) -> str:
        """How the report names it."""
        return LABELS[self]


LABELS = {
    Stage.SCORING: "the scoring pass",
    Stage.GENERATION: "writing calibration text",
    Stage.RECORDING: "recording the statistics",
    Stage.SEARCH: "the plan search",
    Stage.DEPTH: "the quality bound's depths",
    Stage.FRONTIER: "the frontier's depths",
    Stage.SELECTION: "candidate trials",
    Stage.RECONSTRUCTION: "their refits",
    Stage.TUNING: "tuning",
    Stage.HEALING: "healing by distillation",
    Stage.PERPLEXITY: "the held-out perplexity",
}
BEFORE_TUNING = (
    Stage.GENERATION,
    Stage.RECORDING,
    Stage.SEARCH,
    Stage.DEPTH,
    Stage.SELECTION,
    Stage.RECONSTRUCTION,
)  # recovery's work before tuning, what the tuning budget takes first


@dataclass(frozen=True)
class Ledger:
    """Counted work: the price of one pass over each set of batches (a forward and backward pass over the
    calibration batches, a forward pass over the held-out ones), each stage's FLOPs (a stage the run did not
    reach is absent), the tuning's cap (None without one) and, where weights were onloaded, the bytes moved to
    the device and the offloaded weights' bytes (0 where none). `total` is the stages' sum."""

    calibration_pass: float
    heldout_pass: float
    stages: Mapping[Stage, float] = field(default_factory=dict)
    tuning_budget: float | None = None
    moved_bytes: int = 0
    offloaded_bytes: int = 0

    def __getitem__(self, stage: Stage) -> float:
        return self.stages.get(Stage(stage), 0.0)

    def __contains__(self, stage: Stage) -> bool:
        return Stage(stage) in self.stages

    @property
    def total(self) -> float:
        """Every stage's work added up."""
        return sum(self.stages.values())

    def spent(self, stages: Iterable[Stage]) -> float:
        """The work of `stages`, added up."""
        return sum(self[s] for s in stages)

    def passes(self, stages: Iterable[Stage]) -> float:
        """The work of `stages` in calibration passes (a fisher scoring pass is one)."""
        return self.spent(stages) / self.calibration_pass

    def as_dict(self) -> dict[str, float]:
        """The report's form: the two prices, each stage reached, the total and the tuning's cap where set."""
        found = {"calibration_pass": self.calibration_pass, "heldout_pass": self.heldout_pass}
        found.update({s.value: w for s, w in self.stages.items()})
        found["total"] = self.total
        if self.tuning_budget is not None:
            found["tuning_budget"] = self.tuning_budget
        if self.offloaded_bytes:
            found.update(moved_bytes=self.moved_bytes, offloaded_bytes=self.offloaded_bytes)
        return found


class Tally:
    """The work counted while the flow runs: each stage adds to its own entry; `ledger` closes it."""

    def __init__(self, calibration_pass: float, heldout_pass: float) -> None:
        self.calibration_pass, self.heldout_pass = calibration_pass, heldout_pass
        self._stages: dict[Stage, float] = {}

    def add(self, stage: Stage, flops: float) -> None:
        """Count `flops` more for `stage`."""
        self._stages[stage] = self._stages.get(stage, 0.0) + flops

    def spent(self, stages: Iterable[Stage]) -> float:
        """The work of `stages` so far."""
        return sum(self._stages.get(s, 0.0) for s in stages)

    def ledger(self, tuning_budget: float | None = None, moved: int = 0, offloaded: int = 0) -> Ledger:
        """The work counted, closed (nothing added after this shows), with the bytes onloading moved."""
        stages = MappingProxyType({s: self._stages[s] for s in Stage if s in self._stages})
        return Ledger(self.calibration_pass, self.heldout_pass, stages, tuning_budget, moved, offloaded)
