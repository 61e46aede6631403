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
from functools import partial

import torch

from ..model.blocks import Resume, block_chain
from ..model.onload import held, layer_major_chain
from ..model.surgery import PlanError
from ..runtime.parallel import Shards
from ..runtime.progress import progress_bar
from ..runtime.work import Pricer, module_shares
from ..scoring.head_scores import HeadScores
from ..scoring.selection import HeadBudget, removal_units, requested_heads, select_heads
from ..task_data import batch_size
from .candidates import Plan, Trial, unpruned_heldout
from .holdout import set_weights
from .reconstruction import Refit, refit_flops

Unit = tuple[str, tuple[int, ...]]  # (layer name, original heads that go together)
# Each round screens every unit on the first 1/SCREEN of the search's batches and races at most the cheapest MARGIN
# times its share on the rest, a screen's worth at a time: the units it can take (benchmarks/research-log.md, the
# screened search and the raced cut).
SCREEN = 4
MARGIN = 2.0
# A unit leaves the race once its divergences lie more than Z standard errors (paired over the examples both were
# measured on) above the round's cut's, or below those of the cheapest unit the round would not take: two, the
# usual line for "clearly" (the settled cut).
Z = 2.0


def search_order(
    units: dict[str, tuple[list[tuple[int, ...]], int]],
    budget: int,
    rounds: int,
    cost: Callable[[dict[str, tuple[int, ...]], str, int], torch.Tensor],
    parts: int = 1,
    progress: bool = False,
) -> tuple[list[Unit], list[int]]:
    """The units in the order the search removes them, then the units it leaves by their last measured cost,
    and per part of the examples the number of measurements it priced. `units[layer] = (its units, how many
    heads it may lose)`; `budget` heads go in `rounds` rounds of equal shares; `cost(plan, layer, part)`
    gives the per-example divergences on examples `part` of the plan whose `layer` differs from the state so
    far. With two parts or more a round screens the units on the first and races at most the cheapest `MARGIN`
    times its share, in units, over the others until each is clearly in or out (`_measure_round`); after the
    first round it screens only the units an earlier screen does not rule out (`_screen`). Each part is priced
    by the units measured on it; with `progress`, a bar per round counts measurements."""
    removed: dict[str, tuple[int, ...]] = {}
    order: dict[Unit, None] = {}  # the units removed, in order (a dict: membership at thousands of units)
    last: dict[Unit, tuple[int, float]] = {}
    screens: dict[Unit, torch.Tensor] = {}  # each unit's latest screen: what orders the next round's
    priced = [0] * parts
    total = sum(len(u) for u, _ in units.values())
    size = _heads_per_unit([u for us, _ in units.values() for u in us])
    for r in range(rounds):
        gone = sum(len(h) for h in removed.values())
        if gone >= budget:
            break
        share = math.ceil((budget - gone) / (rounds - r))
        eligible = [
            (name, unit)
            for name, (layer_units, room) in units.items()
            for unit in layer_units
            if (name, unit) not in order and len(removed.get(name, ())) + len(unit) <= room
        ]
        present = total - len(order)
        confirmed = min(math.ceil(MARGIN * share / size), present) if parts > 1 else 0
        take = partial(_take, share=share, removed=removed, units=units)  # `removed` as it stands when called
        most = len(eligible) + min(confirmed, len(eligible)) * (parts - 1)  # the bar's total: the race ends early
        bar = progress_bar(None, f"search round {r + 1}/{rounds}", most, progress)
        with bar:
            measure = partial(_measure_one, cost=cost, removed=removed)
            costs, measured = _measure_round(eligible, measure, parts, confirmed, take, screens, bar)
        screens.update({unit: values[0] for unit, values in measured.items()})
        for part in range(parts):
            priced[part] += sum(1 for values in measured.values() if len(values) > part)
        if not costs:
            break
        last = costs
        for name, unit in take(costs):
            order[(name, unit)] = None
            removed[name] = tuple(sorted(removed.get(name, ()) + unit))
    left = [u for u in sorted(last, key=last.__getitem__) if u not in order]
    never = [(n, u) for n, (us, _) in units.items() for u in us if (n, u) not in order and (n, u) not in last]
    return [*order, *left, *never], priced


def _take(
    keys: dict[Unit, tuple[int, float]],
    share: int,
    removed: dict[str, tuple[int, ...]],
    units: dict[str, tuple[list[tuple[int, ...]], int]],
) -> list[Unit]:
    """The units a round takes: the cheapest by `keys` until `share` heads have gone, each only while its layer
    has room for it on top of what `removed` holds."""
    taken: list[Unit] = []
    heads = 0
    gone = dict(removed)
    for name, unit in sorted(keys, key=keys.__getitem__):
        if heads >= share:
            break
        if len(gone.get(name, ())) + len(unit) <= units[name][1]:
            taken.append((name, unit))
            gone[name] = gone.get(name, ()) + unit
            heads += len(unit)
    return taken


def _heads_per_unit(units: list[tuple[int, ...]]) -> float:
    """The mean number of heads in a unit (what turns a share of heads into a count of units)."""
    return sum(len(u) for u in units) / max(len(units), 1)


def _with(removed: dict[str, tuple[int, ...]], unit: Unit) -> dict[str, tuple[int, ...]]:
    """The plan of `removed` with `unit` gone too."""
    name, heads = unit
    return {**removed, name: tuple(sorted(removed.get(name, ()) + heads))}


def _measure_one(unit: Unit, part: int, cost, removed: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """`unit`'s per-example divergences on `part` with it gone on top of `removed`."""
    return cost(_with(removed, unit), unit[0], part)


def _measure_round(
    eligible: list[Unit],
    cost: Callable[[Unit, int], torch.Tensor],
    parts: int,
    confirmed: int,
    take: Callable[[dict[Unit, tuple[int, float]]], list[Unit]],
    earlier: dict[Unit, torch.Tensor],
    bar,
) -> tuple[dict[Unit, tuple[int, float]], dict[Unit, list[torch.Tensor]]]:
    """Each unit's place key, and the divergences of the units measured, per part measured. Without `confirmed`
    every unit is measured on the one part: (0, its mean). Else the units `_screen` picks are screened on the
    first part and `_race` races the cheapest of them over the others; the units not screened rank after all
    others, by the earlier screen's mean: (3, it)."""
    if not confirmed:
        measured = {}
        for unit in eligible:
            measured[unit] = [cost(unit, 0)]
            bar.update()
        return {u: (0, float(v[0].mean())) for u, v in measured.items()}, measured
    screened = _screen(eligible, cost, confirmed, earlier, bar)
    keys, measured = _race(eligible, cost, parts, screened, confirmed, take, bar)
    return {**keys, **{u: (3, float(earlier[u].mean())) for u in eligible if u not in screened}}, measured


def _screen(
    eligible: list[Unit],
    cost: Callable[[Unit, int], torch.Tensor],
    confirmed: int,
    earlier: dict[Unit, torch.Tensor],
    bar,
) -> dict[Unit, torch.Tensor]:
    """The units' divergences on the first part. In the first round every unit is screened. After it, only
    the units whose `earlier` screen (the same examples) is not clearly above that of the dearest there among
    this round's `confirmed` cheapest: before any screen, the earlier screen's cheapest stand in for them;
    each wave screens the units that come within reach, until a wave has none. A unit clearly dearer before
    than every unit this round may measure on the rest stays out of reach: its removal would have to get
    cheaper for it to enter, while what went before mostly makes a removal dearer."""
    screened: dict[Unit, torch.Tensor] = {}
    if not eligible or not all(u in earlier for u in eligible):  # the first round: nothing to rule one out by
        wave = eligible
    else:
        wave = _within_reach(eligible, earlier, sorted(eligible, key=lambda u: float(earlier[u].mean()))[:confirmed])
    while wave:
        for unit in wave:  # in the order of `eligible`: the states entering each block stay reusable
            screened[unit] = cost(unit, 0)
            bar.update()
        if len(screened) == len(eligible):
            break
        margin = sorted(screened, key=lambda u: float(screened[u].mean()))[:confirmed]
        wave = [u for u in _within_reach(eligible, earlier, margin) if u not in screened]
    return screened


def _within_reach(eligible: list[Unit], earlier: dict[Unit, torch.Tensor], margin: list[Unit]) -> list[Unit]:
    """The units whose earlier screen is not clearly above that of the dearest there in `margin`."""
    dearest = earlier[max(margin, key=lambda u: float(earlier[u].mean()))]
    return [u for u in eligible if not _clearly_above(earlier[u], dearest)]


def _race(
    eligible: list[Unit],
    cost: Callable[[Unit, int], torch.Tensor],
    parts: int,
    screened: dict[Unit, torch.Tensor],
    confirmed: int,
    take: Callable[[dict[Unit, tuple[int, float]]], list[Unit]],
    bar,
) -> tuple[dict[Unit, tuple[int, float]], dict[Unit, list[torch.Tensor]]]:
    """The screened units' place keys once the race is run, and their divergences per part measured. The
    `confirmed` cheapest on the screen race over the later parts, one part at a time, in the order of `eligible`
    (what keeps the states entering each block reusable across a part): before each part a unit the round
    takes by the keys so far leaves the race as taken once it lies clearly below the cheapest racing unit it
    does not take, and one it does not take leaves as dropped once it lies clearly above the cut (the last
    unit it takes): Maron and Moore's racing (Hoeffding races, 1994) with a paired test in place of their
    bound. Keys: (0, mean) taken in the race, (1, mean) still racing after the last part, (2, mean) dropped or
    never raced; each over the examples the unit was measured on."""
    measured = {unit: [values] for unit, values in screened.items()}
    racing = sorted(screened, key=lambda u: float(screened[u].mean()))[:confirmed]
    taken: list[Unit] = []
    for part in range(1, parts):
        racing, taken = _decided(measured, racing, taken, take)
        for unit in [u for u in eligible if u in set(racing)]:
            measured[unit].append(cost(unit, part))
            bar.update()
    return _keys(measured, racing, taken), measured


def _decided(
    measured: dict[Unit, list[torch.Tensor]],
    racing: list[Unit],
    taken: list[Unit],
    take: Callable[[dict[Unit, tuple[int, float]]], list[Unit]],
) -> tuple[list[Unit], list[Unit]]:
    """The units still racing and those taken in the race, once each unit that is clearly in or out has left."""
    keys = _keys(measured, racing, taken)
    chosen = take(keys)
    values = {unit: torch.cat(measured[unit]) for unit in [*racing, *chosen[-1:]]}
    cut = values[chosen[-1]] if chosen else None
    spare = next((values[u] for u in sorted(racing, key=keys.__getitem__) if u not in chosen), None)
    clear_in = [u for u in racing if u in chosen and (spare is None or _clearly_above(spare, values[u]))]
    clear_out = [u for u in racing if u not in chosen and _clearly_above(values[u], cut)]
    return [u for u in racing if u not in clear_in and u not in clear_out], [*taken, *clear_in]


def _keys(
    measured: dict[Unit, list[torch.Tensor]], racing: list[Unit], taken: list[Unit]
) -> dict[Unit, tuple[int, float]]:
    """Place keys of the measured units: those taken in the race first, then those racing, then the rest, each
    group by the mean over the examples each was measured on."""
    group = {**dict.fromkeys(racing, 1), **dict.fromkeys(taken, 0)}
    return {u: (group.get(u, 2), float(torch.cat(v).mean())) for u, v in measured.items()}


def _clearly_above(values: torch.Tensor, cut: torch.Tensor | None) -> bool:
    """Whether a unit's per-example divergences lie above the cut's on the examples both were measured on (the
    first of each) by more than Z standard errors of their mean difference: a paired test, since examples
    differ far more from each other than units do on one example."""
    if cut is None or min(len(values), len(cut)) < 2:
        return False
    common = min(len(values), len(cut))
    difference = (values[:common] - cut[:common]).double()
    return bool(difference.mean() > Z * difference.std() / math.sqrt(common))


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


@dataclass(frozen=True)
class Searched:
    """The searched plan (None where it was not tried), its counted work, a note for the report, the units
    the plan removes in the order the search took them (each prefix of it a plan of its own) and the name its
    candidate goes by ("ranked" where the order is the plain ranking's, no search run)."""

    plan: Plan | None
    work: float
    note: str | None = None
    order: list[Unit] = dataclasses.field(default_factory=list)
    name: str = "search"


@dataclass(frozen=True)
class SearchSchedule:
    """How the search measures: in `rounds` rounds, on the first `examples` calibration examples (whole
    batches), each round screening the units on the first `1/SCREEN` of those batches and racing the cheapest
    over the rest (`screen`), or measuring every unit on all of them."""

    rounds: int
    examples: int = 24
    screen: bool = True


def searched_plan(
    trial: Trial,
    scores: HeadScores,
    budget: HeadBudget,
    calib: list[dict],
    schedule: SearchSchedule,
    pricer: Pricer,
    limit: float,
    beside: list[dict] | None = None,
) -> Searched:
    """The plan searched on `calib` as `schedule` says for the selection's `budget`, with its counted work
    (priced by `pricer`), or None and why when that work would pass `limit`; with `beside` (batches of a second
    text, the i-th beside the i-th calibration batch: the general-ability guard's), each measurement also on
    them, the two texts weighted equally (`holdout.balanced`). A unit is measured by a forward
    pass that starts at the unit's block where the model is one chain of blocks and starting there is proven
    exact on it (`prune_heads.model.blocks`), else over the whole model. A bar per round where the trial
    shows progress."""
    asked, rounds = requested_heads(trial.gated.model, budget), schedule.rounds
    batches = first_examples(calib, schedule.examples)
    targets = trial.calibration.targets if trial.calibration is not None else []
    parts = _parts(len(batches), schedule.screen)
    extra = beside or []
    parts_measured = _measured_parts(batches, targets, extra, parts, pricer)
    search = _Search(trial, scores, budget, parts_measured, pricer, extra)
    one = pricer.forward_backward(calib)  # a calibration pass: the unit of the budget a refusal names
    if search.bound(rounds, asked) > limit:
        return search.refused(0.0, one, limit, rounds, asked)
    search.record_beside()
    note = search.start()
    if note is not None and search.bound(rounds, asked) > limit:
        return search.refused(search.proof + search.recording, one, limit, rounds, asked)
    order, priced = search_order(search.units, asked, rounds, search.cost, len(search.parts), trial.progress)
    trial.gated.restore()
    spent = sum(n * search.pass_price(p) for p, n in enumerate(priced)) + search.refitted
    spent += search.proof + search.recording + search.kept_outputs()
    try:
        plan = select_heads(searched_scores(scores, order), budget)
    except PlanError as error:
        return Searched(None, spent, f"search not tried: {error}")
    return Searched(plan, spent, note, [(n, u) for n, u in order if set(u) <= set(plan.get(n, ()))])


def first_examples(calib: list[dict], examples: int) -> list[dict]:
    """The first whole batches that hold `examples` examples (or all of them)."""
    count, batches = 0, []
    for batch in calib:
        if count >= examples:
            break
        batches.append(batch)
        count += batch_size(batch)
    return batches


def _parts(count: int, screen: bool) -> list[range]:
    """The search's `count` batches as the parts it measures on: with `screen` (and two batches or more) runs of
    the first `1/SCREEN` of them (at least one batch each), else all of them as one part."""
    size = max(1, count // SCREEN)
    if not screen or size >= count:
        return [range(count)]
    return [range(i, min(i + size, count)) for i in range(0, count, size)]


def _measured_parts(
    batches: list[dict], targets: list, beside: list[dict], parts: list[range], pricer: Pricer
) -> list[_Part]:
    """Each part's batches (its calibration batches, then those `beside` them) with the unpruned outputs on the
    calibration's, which of `beside` it holds, their forward pass's work and each example's weight (the two
    texts weighted equally over the search)."""
    domain = sum(batch_size(batches[i]) for r in parts for i in r)
    general = sum(batch_size(beside[i]) for r in parts for i in r if i < len(beside))
    weights = set_weights(domain, general) if general else (1.0, 1.0)
    found = []
    for part in parts:
        inside = [i for i in part if i < len(beside)]
        both = [batches[i] for i in part] + [beside[i] for i in inside]
        rows = [weights[0]] * sum(batch_size(batches[i]) for i in part)
        rows += [weights[1]] * sum(batch_size(beside[i]) for i in inside)
        weighed = torch.tensor(rows, dtype=torch.float64)
        found.append(_Part(both, [targets[i] for i in part], inside, pricer.forward(both), weighed))
    return found


@dataclass
class _Part:
    """Batches the search measures on (the calibration's, then a second text's), the unpruned outputs on the
    calibration's, which of the second text's batches it holds, their forward pass's work, each example's weight
    and, once the start at a unit's block is proven, what keeps the states entering each block."""

    batches: list[dict]
    targets: list
    beside: list[int]
    work: float
    weights: torch.Tensor
    resume: Resume | None = None


class _Search:
    """One search's measurements and their prices. A measurement on a part is priced by a forward pass over
    it from the unit's block on; the refits run are counted as they run (`refitted`); the blocks run to keep
    what enters a block are added (at most one pass per round and part); proving that starting part-way is
    exact costs the first part's whole pass and two passes of it from the block that starts latest (`proof`);
    recording the unpruned outputs on a second text's batches costs a pass over them (`recording`). On an
    onloaded model proven layer-major (`onload.prove_layer_major`), each measurement runs its blocks so, each
    moved once."""

    def __init__(
        self,
        trial: Trial,
        scores: HeadScores,
        budget: HeadBudget,
        parts: list[_Part],
        pricer: Pricer,
        beside: list[dict],
    ):
        gated = trial.gated
        self.trial = trial
        self.parts = parts
        self.units = removal_units(scores, budget)
        self.every = [(name, unit) for name, (layer_units, _) in self.units.items() for unit in layer_units]
        self.refit_most = max((self._refit_work(n, u) for n, u in self.every), default=0.0)
        self.chain = chain = block_chain(gated.model, gated.layers)
        self.hold = held if layer_major_chain(gated.model) is not None else None  # onloaded: layer-major
        first = parts[0].batches[0]
        self.shares = None if chain is None else module_shares(gated.model, first, list(chain[0]))
        self.block = {} if chain is None or self.shares is None else dict(zip([l.name for l in gated.layers], chain[1]))
        self.probe = max(self.every, key=lambda u: self.block.get(u[0], 0), default=None)  # starts latest
        if self.probe is None or not self.block.get(self.probe[0]):  # no unit after the first block
            self.block = {}
        shares = self.shares or []
        self.before = [sum(shares[:j]) for j in range(len(shares) + 1)] if self.shares is not None else [0.0]
        self.proof = 0.0
        if self.block and self.probe is not None:
            self.proof = self.parts[0].work + 2 * self.price(self.probe[0], 0)
        self.fitted: dict[Unit, Refit] = {}  # refits a later measurement asks for again (`_refits`)
        self.refitted = 0.0
        self.beside_batches = beside
        self.beside: list = []  # the unpruned outputs on them (`record_beside`)
        self.recording = pricer.forward(beside) if beside else 0.0  # their pass

    def record_beside(self) -> None:
        """Record the unpruned model's outputs on the second text's batches."""
        if self.beside_batches:
            gated, objective = self.trial.gated, self.trial.objective
            self.beside = unpruned_heldout(gated, self.beside_batches, objective, gram=False).targets

    def price(self, name: str, part: int) -> float:
        """A forward pass over `part` from the unit's block on."""
        return self.parts[part].work * (1.0 - self.before[self.block.get(name, 0)])

    def pass_price(self, part: int) -> float:
        """A unit's mean pass on `part`."""
        return sum(self.price(n, part) for n, _ in self.every) / max(len(self.every), 1)

    def bound(self, rounds: int, asked: int) -> float:
        """The most the search can cost: the proof, the recording, every unit screened in every round, at most `MARGIN`
        times the `asked` heads' units measured on each later part per round, a refit per measurement and per
        layer's state in each round, and one pass per round to keep outputs."""
        size = _heads_per_unit([u for _, u in self.every])
        raced = min(len(self.every), math.ceil(MARGIN * asked / size))
        keep = sum(p.work for p in self.parts) if self.block else 0.0
        counts = [raced if p else len(self.every) for p in range(len(self.parts))]
        passes = sum(n * self.pass_price(p) for p, n in enumerate(counts))
        refits = (sum(counts) + len(self.units)) * self.refit_most
        return self.proof + self.recording + rounds * (passes + refits + keep)

    def refused(self, spent: float, one: float, limit: float, rounds: int, asked: int) -> Searched:
        """The search left out, its work (`spent` so far) more than `limit`, said in calibration passes (`one`)."""
        bound = self.bound(rounds, asked) / one
        passes = f"up to {bound:.1f} calibration passes, more than the {max(limit, 0.0) / one:.1f}"
        return Searched(None, spent, f"search not tried: its work ({passes} the budget has left)")

    def start(self) -> str | None:
        """Start measuring from each unit's block where the model is a chain of blocks, once that is proven
        exact on the first part for the unit that starts latest; else measure over the whole model, say so."""
        if not self.block or self.chain is None or self.probe is None:
            return None
        for part in self.parts:
            local = Shards(part.batches).local  # the rows `divergences` runs (data-parallel: this process's)
            part.resume = Resume(self.chain[0], local, self.trial.gated, self.hold)
        name, unit = self.probe
        self.trial.gated.use({name: list(unit)})
        resume = self.parts[0].resume
        assert resume is not None
        if resume.proven(lambda: self._whole_model(0), lambda: self._measured({name: unit}, name, 0)):
            return None
        self.proof += self.kept_outputs()
        for part in self.parts:
            part.resume = None
        self.block = {}  # every unit priced from block 0: a whole pass
        return "search: each forward pass over the whole model (starting at a unit's block was not exact here)"

    def kept_outputs(self) -> float:
        """The work of the blocks run to keep what enters a later one."""
        shares = self.shares or []
        return sum(p.work * sum(n * s for n, s in zip(p.resume.ran, shares)) for p in self.parts if p.resume)

    def _whole_model(self, part: int) -> torch.Tensor:
        p = self.parts[part]
        targets = p.targets + [self.beside[i] for i in p.beside]
        values = self.trial.gated.divergences(p.batches, targets, self.trial.objective, layer_major=False)
        return values * p.weights.to(values.device)

    def _measured(self, plan: dict[str, tuple[int, ...]], changed: str, part: int) -> torch.Tensor:
        """The divergences on `part` of the model as `use`d (in `plan`, which differs from the searched state
        at `changed`), from `changed`'s block on where that is proven."""
        resume = self.parts[part].resume
        if resume is None:
            return self._whole_model(part)
        j = self.block[changed]
        before = tuple(tuple((n, h) for n, h in sorted(plan.items()) if self.block[n] == i) for i in range(j))
        resume.start(j, before)
        with resume.resumed():
            return self._whole_model(part)

    @torch.no_grad()
    def cost(self, plan: dict[str, tuple[int, ...]], changed: str, part: int) -> torch.Tensor:
        """The per-example divergences on `part` with `plan`'s heads gone, each pruned layer refitted."""
        refits = self._refits(plan, changed, part)
        self.trial.gated.use({name: list(heads) for name, heads in plan.items()}, refits=refits)
        return self._measured(plan, changed, part)

    def _refits(self, plan: dict[str, tuple[int, ...]], changed: str, part: int) -> dict[str, Refit]:
        """Each layer's refit in `plan`, kept where a later measurement asks for it again: the state so far of
        the layers other than `changed`, and `changed`'s where its unit races (a part after the screen: the next
        part asks again, and the next round where the layer loses nothing). A layer's refit depends on its
        heads alone, so a kept one is the one a fit would give; it is forgotten once its layer has lost a head
        it keeps (no later plan asks for it). So what is kept is each layer's state and the refits of the units
        raced since their layer last lost heads: at most a round's `MARGIN` times its share, per round."""
        self.fitted = {
            (name, heads): fitted
            for (name, heads), fitted in self.fitted.items()
            if name == changed or set(plan.get(name, ())) <= set(heads)
        }
        refits = {}
        for name, heads in plan.items():
            found = self.fitted.get((name, heads))
            if found is None:
                found = self.trial.refit(name, heads)
                self.refitted += self._refit_work(name, heads)
                if name != changed or part > 0:
                    self.fitted[(name, heads)] = found
            refits[name] = found
        return refits

    def _refit_work(self, name: str, heads: tuple[int, ...]) -> float:
        gated = self.trial.gated
        return refit_flops([gated.layers[gated.index[name]]], {name: list(heads)})
