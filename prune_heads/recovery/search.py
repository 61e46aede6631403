"""The searched plan: remove heads in rounds by their measured cost. Each round measures, for every unit that
may still go (a KV group, a head, one head of every group, a whole block: as selection removes them), the
divergence of the model from the unpruned one when that unit goes on top of what went in earlier rounds, each
pruned layer with its reconstruction, and removes the cheapest units up to the round's share of the budget.
Per-head estimates (gradients, Fisher blocks, a layer's own reconstruction error) cannot see what a layer's
removal does further on, nor that a head the others stood in for matters once its neighbour has gone; this
measures both, at the price of one forward pass over a few calibration examples per unit and round, from
the unit's block on where the model is one chain of blocks (`prune_heads.model.blocks`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model.blocks import Resume, block_chain
from ..model.surgery import PlanError
from ..runtime.progress import progress_bar
from ..runtime.work import Work, module_shares
from ..scoring.head_scores import HeadScores
from ..scoring.selection import HeadBudget, removal_units, requested_heads, select_heads
from ..task_data import batch_size
from .candidates import Plan, Trial
from .reconstruction import Refit, refit_flops

Unit = tuple[str, tuple[int, ...]]  # (layer name, original heads that go together)
# The default rounds where the outputs are per position (a language model's tokens). Where each example gives
# one output (a class, a value, an embedding) the default runs none: on the classifier fixtures its plan lost
# on held-out data in every cell measured, even on 256 examples (benchmarks/research-log.md, the searched plan).
ROUNDS = 2


def search_order(
    units: dict[str, tuple[list[tuple[int, ...]], int]],
    budget: int,
    rounds: int,
    cost: Callable[[dict[str, tuple[int, ...]], str], float],
    progress: bool = False,
) -> tuple[list[Unit], list[int]]:
    """The units in the order the search removes them, then the units it leaves by their last measured cost,
    and per round run the number of units still present at its start (what its work is priced by: the same
    on any device, whichever units the measured values make eligible). `units[layer] = (its units, how many
    heads it may lose)`; `budget` heads go in `rounds` rounds of equal shares; `cost(plan, layer)` measures
    the plan whose `layer` differs from the state so far; with `progress`, a bar per round counts the units
    measured of those eligible."""
    removed: dict[str, tuple[int, ...]] = {}
    order: dict[Unit, None] = {}  # the units removed, in order (a dict: membership at thousands of units)
    last: dict[Unit, float] = {}
    present: list[int] = []
    total = sum(len(u) for u, _ in units.values())
    for r in range(rounds):
        gone = sum(len(h) for h in removed.values())
        if gone >= budget:
            break
        present.append(total - len(order))
        share = math.ceil((budget - gone) / (rounds - r))
        eligible = [
            (name, unit)
            for name, (layer_units, room) in units.items()
            for unit in layer_units
            if (name, unit) not in order and len(removed.get(name, ())) + len(unit) <= room
        ]
        costs: dict[Unit, float] = {}
        for name, unit in progress_bar(eligible, f"search round {r + 1}/{rounds}", len(eligible), progress):
            costs[(name, unit)] = cost({**removed, name: tuple(sorted(removed.get(name, ()) + unit))}, name)
        if not costs:
            break
        last = costs
        taken = 0
        for name, unit in sorted(costs, key=costs.__getitem__):
            heads = removed.get(name, ())
            if taken >= share:
                break
            if len(heads) + len(unit) <= units[name][1]:
                order[(name, unit)] = None
                removed[name] = tuple(sorted(heads + unit))
                taken += len(unit)
    left = [u for u in sorted(last, key=last.__getitem__) if u not in order]
    never = [(n, u) for n, (us, _) in units.items() for u in us if (n, u) not in order and (n, u) not in last]
    return [*order, *left, *never], present


def searched_scores(scores: HeadScores, order: list[Unit]) -> HeadScores:
    """Scores that rank the heads as `order` does (a unit's place, shared out over its heads), so that
    `select_heads` with them takes the searched units under every constraint of the budget; heads in no unit
    (protected layers) score above all."""
    place = {(name, h): i / len(unit) for i, (name, unit) in enumerate(order) for h in unit}
    top = float(len(order) + 1)
    values = {
        name: torch.tensor([place.get((name, h), top) for h in heads], dtype=torch.float32)
        for name, heads in scores.heads.items()
    }
    return dataclasses.replace(scores, method="search", scores=values, variance=None, meta={})


@dataclass
class Searched:
    """The searched plan (None where it was not tried), its counted work, and a note for the report."""

    plan: Plan | None
    work: float
    note: str | None = None


def searched_plan(
    trial: Trial,
    scores: HeadScores,
    budget: HeadBudget,
    calib: list[dict],
    rounds: int,
    examples: int,
    work: Work,
    limit: float,
) -> Searched:
    """The plan searched in `rounds` rounds on the first `examples` calibration examples (whole batches) for
    the selection's `budget`, with its counted work (priced by `work`), or None and why when that work would
    pass `limit`. A unit is measured by a forward pass over those examples that starts at the unit's block
    where the model is one chain of blocks and starting there is proven exact on it
    (`prune_heads.model.blocks`), else over the whole model. A bar per round where the trial shows progress."""
    search = _Search(trial, scores, budget, _first_examples(calib, examples), work, rounds)
    one = work.forward_backward(calib)  # a calibration pass: the unit of the budget a refusal names
    if search.bound() > limit:
        return search.refused(0.0, one, limit)
    note = search.start()
    if note is not None and search.bound() > limit:
        return search.refused(search.proof, one, limit)
    asked = requested_heads(trial.gated.model, budget)
    order, present = search_order(search.units, asked, rounds, search.cost, trial.progress)
    trial.gated.restore()
    spent = sum(present) * search.unit_price() + search.proof + search.kept_outputs()
    try:
        return Searched(select_heads(searched_scores(scores, order), budget), spent, note)
    except PlanError as error:
        return Searched(None, spent, f"search not tried: {error}")


def _first_examples(calib: list[dict], examples: int) -> list[dict]:
    """The first whole batches that hold `examples` examples (or all of them)."""
    count, batches = 0, []
    for batch in calib:
        if count >= examples:
            break
        batches.append(batch)
        count += batch_size(batch)
    return batches


class _Search:
    """One search's measurements and their prices. Each round is priced by the units present at its start
    (their mean price: a forward pass from the unit's block on, and the unit's refit) and by the blocks run to
    keep what enters a block (at most one pass); proving that starting part-way is exact costs the whole pass
    and two passes from the block that starts latest (`proof`)."""

    def __init__(
        self, trial: Trial, scores: HeadScores, budget: HeadBudget, batches: list[dict], work: Work, rounds: int
    ) -> None:
        gated = trial.gated
        self.trial, self.batches, self.rounds = trial, batches, rounds
        self.targets = trial.calibration.targets[: len(batches)] if trial.calibration is not None else []
        self.units = removal_units(scores, budget)
        self.every = [(name, unit) for name, (layer_units, _) in self.units.items() for unit in layer_units]
        self.whole = work.forward(batches)
        self.refits = sum(refit_flops([gated.layers[gated.index[n]]], {n: list(u)}) for n, u in self.every)
        self.chain = chain = block_chain(gated.model, gated.layers)
        self.shares = None if chain is None else module_shares(gated.model, batches[0], list(chain[0]))
        self.block = {} if chain is None or self.shares is None else dict(zip([l.name for l in gated.layers], chain[1]))
        self.probe = max(self.every, key=lambda u: self.block.get(u[0], 0), default=None)  # starts latest
        if self.probe is None or not self.block.get(self.probe[0]):  # no unit after the first block
            self.block = {}
        shares = self.shares or []
        self.before = [sum(shares[:j]) for j in range(len(shares) + 1)] if self.shares is not None else [0.0]
        self.proof = self.whole + 2 * self.price(self.probe[0]) if self.block and self.probe is not None else 0.0
        self.resume: Resume | None = None
        self.kept: dict[tuple[str, tuple[int, ...]], Refit] = {}  # the refits of the state so far, by layer

    def price(self, name: str) -> float:
        """A forward pass from the unit's block on."""
        return self.whole * (1.0 - self.before[self.block.get(name, 0)])

    def unit_price(self) -> float:
        """A unit's mean price: its pass and its refit."""
        return (sum(self.price(n) for n, _ in self.every) + self.refits) / max(len(self.every), 1)

    def bound(self) -> float:
        """The most the search can cost: the proof, every unit in every round, and one pass to keep outputs."""
        return self.proof + self.rounds * (len(self.every) * self.unit_price() + (self.whole if self.block else 0.0))

    def refused(self, spent: float, one: float, limit: float) -> Searched:
        """The search left out, its work (`spent` so far) more than `limit`, said in calibration passes (`one`)."""
        passes = f"up to {self.bound() / one:.1f} calibration passes, more than the {max(limit, 0.0) / one:.1f}"
        return Searched(None, spent, f"search not tried: its work ({passes} the budget has left)")

    def start(self) -> str | None:
        """Start measuring from each unit's block where the model is a chain of blocks, once that is proven
        exact on the unit that starts latest; else measure over the whole model and say so."""
        if not self.block or self.chain is None or self.probe is None:
            return None
        self.resume = Resume(self.chain[0], self.batches, self.trial.gated)
        name, unit = self.probe
        self.trial.gated.use({name: list(unit)})
        if self.resume.proven(self._whole_model, lambda: self._measured({name: unit}, name)):
            return None
        self.proof += self.kept_outputs()
        self.resume, self.block = None, {}  # every unit priced from block 0: a whole pass
        return "search: each forward pass over the whole model (starting at a unit's block was not exact here)"

    def kept_outputs(self) -> float:
        """The work of the blocks run to keep what enters a later one."""
        if self.resume is None:
            return 0.0
        return self.whole * sum(n * share for n, share in zip(self.resume.ran, self.shares or []))

    def _whole_model(self) -> torch.Tensor:
        return self.trial.gated.divergences(self.batches, self.targets, self.trial.objective)

    def _measured(self, plan: dict[str, tuple[int, ...]], changed: str) -> torch.Tensor:
        """The divergences of the model as `use`d (in `plan`, which differs from the searched state at
        `changed`), from `changed`'s block on where that is proven."""
        if self.resume is None:
            return self._whole_model()
        j = self.block[changed]
        before = tuple(tuple((n, h) for n, h in sorted(plan.items()) if self.block[n] == i) for i in range(j))
        self.resume.start(j, before)
        with self.resume.replaying():
            return self._whole_model()

    @torch.no_grad()
    def cost(self, plan: dict[str, tuple[int, ...]], changed: str) -> float:
        """The mean divergence with `plan`'s heads gone, each pruned layer refitted (those other than
        `changed` kept from the state so far)."""
        for key in [k for k in self.kept if plan.get(k[0]) != k[1]]:
            del self.kept[key]
        for name, heads in plan.items():
            if name != changed and (name, heads) not in self.kept:
                self.kept[(name, heads)] = self.trial.refit(name, heads)
        refits = {name: self.kept[(name, heads)] for name, heads in plan.items() if name != changed}
        refits[changed] = self.trial.refit(changed, plan[changed])
        self.trial.gated.use({name: list(heads) for name, heads in plan.items()}, refits=refits)
        return float(self._measured(plan, changed).mean())
