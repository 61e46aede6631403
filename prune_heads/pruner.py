"""`prune_model`: the whole pruning flow in one call, the best measured path by default.

Score the heads on calibration batches (their held-out part aside), build the candidate plans, and try each
on the gated model against the unpruned outputs on the held-out part; then keep each recovery step (bias
compensation, gate, bias and projection tuning) only if it lowers that held-out divergence. Everything is tried
on the one model through gates, added biases and low-rank updates, then folded into the weights and the heads
removed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .config import ConfigError, PruneConfig, RecoveryConfig
from .data import DataError, TaskData, batch_size, input_device, to_device, with_targets, without_labels
from .export.persistence import output_biases_load
from .model.blocks import Resume, block_chain
from .model.layers import require_attention
from .model.probe import probe_layers
from .model.surgery import PlanError
from .recovery.gated import GatedModel
from .recovery.generated import token_batches, with_generated, writes_text
from .recovery.holdout import one_standard_error, split_holdout
from .recovery.reconstruction import Refit, refit, refit_flops, removal_cost
from .recovery.search import ROUNDS, search_order, searched_scores
from .recovery.tuning import tune
from .runtime.memory import release_freed_memory
from .runtime.work import Budget, Work, module_shares
from .scoring.head_scores import HeadScores
from .scoring.iterative import prune_iteratively
from .scoring.methods import fluctuation, head_scores, score_heads
from .scoring.objective import Objective, frozen
from .scoring.recording import Recorder, record
from .scoring.selection import check_budget, heads_for_flops, removal_units, requested_heads, select_heads

logger = logging.getLogger("prune_heads")
BEFORE_TUNING = ("generation", "recording", "search", "selection")  # recovery's counted work before tuning


@dataclass
class PruneResult:
    """What `prune_model` did: the plan (original head indices per layer), the scores it was chosen from,
    the per-step history of iterative pruning, each recovery decision (`recovery`: what was tried, its
    held-out divergence from the unpruned model, what was kept, seconds), the held-out summary, the heads the
    budget asked for (`asked`; `heads_removed` differs only with `selection.round`), the work of each stage
    in counted FLOPs with the tuning's budget (`work`: what limits the flow, never a clock) and the seconds
    per stage (informative only)."""

    plan: dict[str, list[int]]
    scores: HeadScores | None = None
    history: list[dict] = field(default_factory=list)
    recovery: list[dict] = field(default_factory=list)
    heldout: dict[str, Any] = field(default_factory=dict)
    asked: int | None = None
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    work: dict[str, float] = field(default_factory=dict)

    @property
    def heads_removed(self) -> int:
        """Heads the plan removed."""
        return sum(len(h) for h in self.plan.values())


def selection_budget(model: nn.Module, config: PruneConfig, seq_len: int = 128) -> dict[str, Any]:
    """The `select_heads` keyword arguments of `config.selection`, checked against the model's structure
    before any data is read (a FLOPs budget becomes the smallest reachable number of heads that meets it).
    Raises PlanError naming the nearest reachable budgets when the structure cannot meet the request."""
    selection = config.selection
    kwargs = selection.budget()
    if selection.flops is not None:
        kwargs["num_heads"] = heads_for_flops(model, selection.flops, seq_len=seq_len)
        kwargs["round"] = kwargs.get("round") or "up"
    if config.scoring.steps > 1:
        if config.recovery.enabled:
            raise ConfigError(
                "iterative pruning (scoring.steps > 1) re-scores the pruned model, which recovery "
                "cannot follow; turn recovery off (--no-recovery, or recovery: off in a recipe)"
            )
        if kwargs.get("sparsity") is None:
            raise ConfigError("iterative pruning (scoring.steps > 1) needs selection.sparsity")
    check_budget(model, **kwargs)
    return kwargs


def _candidates(
    scores: HeadScores, recorder: Recorder | None, layers, kwargs: dict, config: RecoveryConfig, notes: list[str]
) -> dict[str, dict[str, list[int]]]:
    """The plans to try: the plain ranking, and with `rearrange` the Fisher-block and FLAP plans and, with
    `reconstruction`, the structured-OBS plan (what the kept heads can stand in for, refitted)."""
    plans = {"ranked": select_heads(scores, **kwargs)}
    if recorder is None or not config.rearrange:
        return plans
    strategies: dict[str, Any] = {"interactions": "interactions"}
    if config.reconstruction:
        strategies["OBS"] = removal_cost(layers, recorder.moments)
    for name, strategy in strategies.items():
        try:
            plans[name] = select_heads(scores, strategy=strategy, **kwargs)
        except PlanError as error:
            notes.append(f"{name} not tried: {error}")
    variances = recorder.variances()
    groups = kwargs.get("gqa", "groups") == "groups"
    fluct = head_scores("fluctuation", layers, fluctuation(layers, variances, groups), scores.num_examples)
    plans["fluctuation"] = select_heads(fluct, **kwargs)
    return plans


def _refits(
    layers, plan: dict[str, list[int]], recorder: Recorder, heldout: Recorder | None, bias: bool, notes: list[str]
) -> dict[str, Refit]:
    """Each pruned layer's reconstruction for the plan (with its output bias unless `bias` is False); a
    fallback to bias compensation is said in the notes."""
    found = {}
    for i, layer in enumerate(layers):
        if plan.get(layer.name):
            held = heldout.moments[i] if heldout is not None else None
            found[layer.name] = refit(layer, plan[layer.name], recorder.moments[i], held, bias)
            why = found[layer.name].fallback
            note = f"{layer.name}: reconstruction fell back to bias compensation: {why}"
            if why is not None and note not in notes:
                notes.append(note)
                logger.warning(note)
    return found


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
    with Recorder(gated.model, gated.layers, objective, gram=gram) as recorder:
        gated.use({})
        for batch in heldout:
            gated(batch)
            release_freed_memory()
    return recorder


def prune_model(
    model: nn.Module, data: TaskData | Iterable[dict], config: PruneConfig | None = None, progress: bool = True
) -> PruneResult:
    """Prune `model` in place, the whole flow in one call, and say what was done.

    `data`: a `TaskData` from `ph.load_task_data` or any iterable of batch dicts (labels optional), used for
    scoring and calibration, never the evaluation split. `config` (default `PruneConfig()`: fisher scores, half
    the heads, held-out recovery) sets scoring, selection and recovery; `PruneConfig.from_recipe` builds one
    from a recipe. The budget is checked against the model's structure before any data is read. With recovery
    on, a decoder-only language model can first write calibration text of its own beside the batches
    (`recovery.generated_share`, off by default), and `recovery.holdout` of the batches is held out: the
    candidate plans (the plain ranking, Kwon et al.'s Fisher-block rearrangement, FLAP's fluctuation,
    structured OBS, the plan searched by measured removals), each with its closed-form reconstruction (or bias
    compensation), and gate, bias and projection tuning with early stopping are kept only when they lower the
    divergence from the unpruned model there, so the result is never worse on held-out data than the plain
    selection (docs/recovery.md). No copy of the model is made: candidates and tuning run on the model itself through
    gates, then folded in.
    """
    config = config or PruneConfig()
    start = time.perf_counter()
    s, r = config.scoring, config.recovery
    batches = list(data) if s.steps > 1 else with_targets(data)  # an encoder's labels score one-shot only
    if not batches:
        raise DataError("no calibration batches: give data with at least one example")
    seq_len = next((v.shape[-1] for v in batches[0].values() if torch.is_tensor(v) and v.dim() > 1), 128)
    kwargs = selection_budget(model, config, seq_len)
    asked = requested_heads(model, **kwargs)
    generated: list[dict] = []
    share = _generated_share(model, batches, r)  # only with recovery on, so never with steps > 1
    if share:
        batches, generated = with_generated(model, batches, share, s.seed)
    if s.objective == "label-free":
        batches = [without_labels(b) for b in batches]
    if s.steps > 1:
        found = prune_iteratively(
            model, batches, steps=s.steps, method=s.method, seed=s.seed, progress=progress, **kwargs
        )
        return PruneResult(found.plan, found.scores, found.history, asked=asked, seconds=time.perf_counter() - start)
    calib, heldout = split_holdout(batches, r.holdout if r.enabled else 0.0)
    layers = require_attention(model)
    probe_layers(model, layers, to_device(without_labels(calib[0]), input_device(model)))
    objective = Objective(model)
    timings: dict[str, float] = {}
    tick = time.perf_counter()
    # recovery needs the unpruned model's statistics and outputs, recorded during scoring; the Gram matrices
    # (a share of the weights) in a no-grad pass of their own instead, not beside the scoring's activations
    during = r.enabled and not r.reconstruction
    with Recorder(model, layers, objective) if during else nullcontext() as recorder:
        scores = score_heads(model, calib, method=s.method, normalize=s.normalize, seed=s.seed, progress=progress)
    device = input_device(model)
    calib = [to_device(without_labels(b), device) for b in calib]
    recorded = r.enabled and (recorder is None or recorder.calls != len(calib))  # no plain pass per batch
    if recorded:
        recorder = record(model, calib, objective, r.reconstruction)
    timings["scoring"] = time.perf_counter() - tick
    notes: list[str] = []
    if (
        r.enabled
        and (r.bias_compensation or r.bias_tuning)
        and config.selection.uniform
        and not output_biases_load(model)
    ):
        notes.append("no output biases added: a stock config of this model cannot hold them (uniform)")
        config = dataclasses.replace(
            config, recovery=dataclasses.replace(r, bias_compensation=False, bias_tuning=False)
        )
        r = config.recovery
    plans = _candidates(scores, recorder, layers, kwargs, r, notes)
    result = PruneResult(plan=plans["ranked"], scores=scores, asked=asked)
    gated = GatedModel(model, layers)
    with frozen(model), gated:
        work = Work.of(gated.model, calib[0])
        result.work = {"calibration_pass": work.forward_backward(calib), "heldout_pass": work.forward(heldout)}
        if recorded:
            result.work["recording"] = work.forward(calib)
        if generated:  # sampled with the KV cache: a forward pass over the written tokens
            result.work["generation"] = work.forward(generated)
        choice = _choose(
            gated, plans, recorder, calib, heldout, objective, config, result, timings, notes, device, kwargs, work
        )
    # proven exact before tuning (a refused plan leaves the model as it was), so that tuning, the flow's peak,
    # runs without the output projections' originals beside the model
    gated.prove(choice.plan, calib[0])
    if recorder is not None:
        recorder.release_moments()
        with frozen(model), gated:
            _tune(gated, choice, recorder, calib, objective, config, result, timings)
    gated.fold(choice.plan)
    result.plan = choice.plan
    if notes:
        result.recovery.insert(0, {"step": "notes", "notes": notes})
    result.timings = {k: round(v, 3) for k, v in timings.items()}
    result.seconds = time.perf_counter() - start
    return result


def _generated_share(model: nn.Module, batches: list[dict], r: RecoveryConfig) -> float:
    """`r.generated_share`; a share asked of a model or data that cannot take it is refused (before any
    scoring)."""
    if r.generated_share and not (writes_text(model) and token_batches(batches)):  # checked only when asked
        raise ConfigError(
            f"recovery.generated_share is {r.generated_share}, but only a decoder-only language model on batches "
            "of token ids writes its own calibration text; give 0 (or leave it out) for this model"
        )
    return r.generated_share


@dataclass
class State:
    """A candidate state of the gated model: the plan, and the added biases or the reconstruction with it."""

    plan: dict[str, list[int]]
    biases: dict[str, torch.Tensor] | None = None
    refits: dict[str, Refit] | None = None


@dataclass
class Choice:
    """The chosen candidate's plan and what tuning is checked with: the candidate's held-out values (None
    without held-out data), the held-out batches on the model's device, the unpruned model's outputs on them
    and the model's work counter."""

    plan: dict[str, list[int]]
    values: torch.Tensor | None
    heldout: list[dict]
    targets: list
    work: Work


def _searched(
    gated: GatedModel,
    scores: HeadScores,
    kwargs: dict,
    recorder: Recorder,
    unpruned: Recorder,
    calib: list[dict],
    objective: Objective,
    config: RecoveryConfig,
    rounds: int,
    work: Work,
    limit: float,
) -> tuple[dict[str, list[int]] | None, float, str | None]:
    """The plan searched in `rounds` rounds (`prune_heads.recovery.search`) on the first `search_examples`
    calibration examples, with its counted work, or None and why when its work would pass `limit`. A unit is
    measured by a forward pass over those examples that starts at the unit's block where the model is one
    chain of blocks and starting there is proven exact on it (`prune_heads.model.blocks`), else over the whole
    model. Each round is priced by the units present at its start (their mean price: the blocks from theirs
    on, and a layer's refit) and the blocks run to keep what enters theirs (at most one pass)."""
    bias = config.bias_tuning or config.bias_compensation
    count, batches = 0, []
    for batch in calib:
        if count >= config.search_examples:
            break
        batches.append(batch)
        count += batch_size(batch)
    targets = recorder.targets[: len(batches)]
    units = removal_units(scores, **kwargs)
    index = {layer.name: i for i, layer in enumerate(gated.layers)}
    every = [(name, unit) for name, (layer_units, _) in units.items() for unit in layer_units]
    whole = work.forward(batches)
    refits = sum(refit_flops([gated.layers[index[n]]], {n: list(u)}) for n, u in every)
    chain = block_chain(gated.model, gated.layers)
    shares = None if chain is None else module_shares(gated.model, batches[0], list(chain[0]))
    block = {} if chain is None or shares is None else {l.name: b for l, b in zip(gated.layers, chain[1])}
    probe = max(every, key=lambda u: block.get(u[0], 0), default=None)  # the unit whose passes start latest
    if probe is None or not block.get(probe[0]):  # no unit after the first block: nothing to start later
        block = {}
    before = [0.0] if shares is None else [sum(shares[:j]) for j in range(len(shares) + 1)]  # before[0] is 0

    def price(name: str) -> float:  # a forward pass from the unit's block on
        return whole * (1.0 - before[block.get(name, 0)])

    def priced(spent: float) -> tuple[float, float]:  # a unit's mean price, and the bound with `spent` before
        unit = (sum(price(n) for n, _ in every) + refits) / max(len(every), 1)
        return unit, spent + rounds * (len(every) * unit + (whole if block else 0.0))

    def refused(bound: float, spent: float) -> tuple[None, float, str]:
        one, left = work.forward_backward(calib), max(limit, 0.0)  # one: the unit of tuning_budget
        why = f"up to {bound / one:.1f} calibration passes, more than the {left / one:.1f} the budget has left"
        return None, spent, f"search not tried: its work ({why})"

    # the proof: the whole pass and two from the probe's block
    proof = whole + 2 * price(probe[0]) if block and probe is not None else 0.0
    price_of_unit, bound = priced(proof)
    if bound > limit:
        return refused(bound, 0.0)
    resume = Resume(chain[0], batches, gated) if block and chain is not None else None
    kept: dict[tuple[str, tuple[int, ...]], Refit] = {}  # the refits of the state so far, layer by layer

    def fitted(name: str, heads: tuple[int, ...]) -> Refit:
        gated.restore()  # fitted against the unpruned weights
        i = index[name]
        return refit(gated.layers[i], heads, recorder.moments[i], unpruned.moments[i], bias)

    def measured(plan: dict[str, tuple[int, ...]], changed: str) -> torch.Tensor:
        """The divergences of the model as `use`d (in `plan`, which differs from the searched state at
        `changed`), from `changed`'s block on where that is proven."""
        if resume is None:
            return gated.divergences(batches, targets, objective)
        j = block[changed]
        resume.start(j, tuple(tuple((n, h) for n, h in sorted(plan.items()) if block[n] == i) for i in range(j)))
        with resume.replaying():
            return gated.divergences(batches, targets, objective)

    def kept_outputs() -> float:  # the work of the blocks run to keep what enters a later one
        return 0.0 if resume is None else whole * sum(n * share for n, share in zip(resume.ran, shares or []))

    why = None
    if resume is not None and probe is not None:
        name, unit = probe
        gated.use({name: list(unit)})
        whole_model = lambda: gated.divergences(batches, targets, objective)  # noqa: E731
        if not resume.proven(whole_model, lambda: measured({name: unit}, name)):
            proof += kept_outputs()
            resume, block = None, {}  # every unit priced from block 0: a whole pass
            why = "search: each forward pass over the whole model (starting at a unit's block was not exact here)"
            price_of_unit, bound = priced(proof)
            if bound > limit:
                return refused(bound, proof)

    @torch.no_grad()
    def cost(plan: dict[str, tuple[int, ...]], changed: str) -> float:
        for key in [k for k in kept if plan.get(k[0]) != k[1]]:
            del kept[key]
        for name, heads in plan.items():
            if name != changed and (name, heads) not in kept:
                kept[(name, heads)] = fitted(name, heads)
        refits = {name: kept[(name, heads)] for name, heads in plan.items() if name != changed}
        refits[changed] = fitted(changed, plan[changed])
        gated.use({name: list(heads) for name, heads in plan.items()}, refits=refits)
        return float(measured(plan, changed).mean())

    order, present = search_order(units, requested_heads(gated.model, **kwargs), rounds, cost)
    gated.restore()
    spent = sum(present) * price_of_unit + proof + kept_outputs()
    try:
        return select_heads(searched_scores(scores, order), **kwargs), spent, why
    except PlanError as error:
        return None, spent, f"search not tried: {error}"


def _choose(
    gated: GatedModel,
    plans: dict,
    recorder: Recorder | None,
    calib: list[dict],
    heldout: list[dict],
    objective: Objective,
    config: PruneConfig,
    result: PruneResult,
    timings: dict,
    notes: list[str],
    device,
    kwargs: dict,
    work: Work,
) -> Choice:
    """Choose the plan and its reconstruction (or bias compensation) on the held-out batches and leave `gated`
    in that state; with `search_rounds`, the searched plan (for the selection's `kwargs`) is a candidate too,
    within what the tuning budget has left. The work is counted in FLOPs (`result.work`), priced by `work`."""
    r = config.recovery
    tick = time.perf_counter()
    heldout = [to_device(without_labels(b), device) for b in heldout]
    unpruned = unpruned_heldout(gated, heldout, objective, r.reconstruction) if heldout else None
    targets = unpruned.targets if unpruned is not None else []

    def divergences(state: State) -> torch.Tensor | None:
        gated.use(state.plan, state.biases, state.refits)
        return gated.divergences(heldout, targets, objective) if heldout else None

    def reconstructed(plan: dict[str, list[int]]) -> State:
        assert recorder is not None
        gated.restore()  # fitted against the unpruned weights, not a candidate's refit written into them
        fitted = _refits(gated.layers, plan, recorder, unpruned, r.bias_tuning or r.bias_compensation, notes)
        result.work["reconstruction"] += refit_flops(gated.layers, plan)
        return State(plan, refits=fitted)

    if r.rearrange and r.reconstruction and recorder is not None and unpruned is not None:
        rounds = r.search_rounds
        if rounds is None:  # the default: only where the outputs are per position
            rounds = ROUNDS if objective.per_position(targets[0]) else 0
        if rounds:
            spent = sum(result.work.get(k, 0.0) for k in BEFORE_TUNING)  # the writing and the recording
            limit = math.inf if r.tuning_budget is None else r.tuning_budget * result.work["calibration_pass"] - spent
            assert result.scores is not None
            plan, result.work["search"], why = _searched(
                gated, result.scores, kwargs, recorder, unpruned, calib, objective, r, rounds, work, limit
            )
            if plan is not None:
                plans = {**plans, "search": plan}
            if why is not None:
                notes.append(why)
    tried: dict[str, tuple[torch.Tensor | None, State]] = {}  # in order of preference
    result.work["reconstruction"] = 0.0
    for name, plan in plans.items():
        if name == "ranked" or not r.reconstruction:
            tried[name] = (divergences(State(plan)), State(plan))
        if recorder is None:
            continue
        if r.reconstruction:  # a candidate's refits (a share of the weights each) are made again if chosen
            tried[f"{name} + reconstruction"] = (divergences(reconstructed(plan)), State(plan))
        elif r.bias_compensation:
            state = State(plan, biases=gated.compensation(plan, recorder.means()))
            tried[f"{name} + bias compensation"] = (divergences(state), state)
    if heldout:
        chosen = one_standard_error({k: v[0] for k, v in tried.items() if v[0] is not None})
    else:  # nothing to check against: every enabled step, as configured
        plan_name = "OBS" if "OBS" in plans else "interactions" if "interactions" in plans else "ranked"
        step = " + reconstruction" if r.reconstruction else " + bias compensation" if r.bias_compensation else ""
        chosen = plan_name + step
    values, state = tried[chosen]
    if chosen.endswith(" + reconstruction"):
        state = reconstructed(state.plan)
    value = None if values is None else float(values.mean())
    result.work["selection"] = (len(tried) + 1) * result.work["heldout_pass"] + result.work["reconstruction"]
    entry: dict[str, Any] = {
        "step": "selection",
        "kept": chosen,
        "seconds": round(time.perf_counter() - tick, 3),
        "tried": {k: None if v[0] is None else float(v[0].mean()) for k, v in tried.items()},
    }
    if state.refits:
        entry["reconstruction"] = _summary(state.refits)
    result.recovery.append(entry)
    result.heldout = {
        "batches": len(heldout),
        "examples": sum(batch_size(b) for b in heldout),
        "plain": entry["tried"]["ranked"],
        "selected": value,
    }
    timings["selection"] = time.perf_counter() - tick
    gated.use(state.plan, state.biases, state.refits)
    result.heldout["final"] = value
    return Choice(state.plan, values, heldout, targets, work)


def _tune(
    gated: GatedModel,
    choice: Choice,
    recorder: Recorder,
    calib: list[dict],
    objective: Objective,
    config: PruneConfig,
    result: PruneResult,
    timings: dict,
) -> None:
    """Tune the chosen state's gates, output biases and projection updates to the unpruned outputs, kept only
    when the held-out divergence falls by more than one standard error; bounded by `tuning_budget` when set."""
    r, seed, heldout, targets = config.recovery, config.scoring.seed, choice.heldout, choice.targets
    if r.tuning and r.epochs > 0:
        tick = time.perf_counter()
        untuned = [b.detach().clone() for b in gated.biases]
        gated.scales = [s.requires_grad_(r.gate_tuning) for s in gated.scales]
        gated.biases = [b.requires_grad_(r.bias_tuning) for b in gated.biases]
        updates = gated.add_updates(r.projection_rank, seed) if r.projection_tuning else []
        tunables = [
            (name, params, lr)
            for name, params, lr, on in (
                ("gate", gated.scales, r.gate_lr, r.gate_tuning),
                ("bias", gated.biases, r.bias_lr, r.bias_tuning),
                ("projection", updates, r.projection_lr, r.projection_tuning),
            )
            if on
        ]
        groups = [{"params": params, "lr": lr} for _, params, lr in tunables]
        check = (lambda: float(gated.divergences(heldout, targets, objective).mean())) if heldout else None
        before = sum(result.work.get(k, 0.0) for k in BEFORE_TUNING)
        limit = (  # None: no cap, the held-out stop and `epochs` end tuning
            None
            if r.tuning_budget is None
            else max(r.min_tuning_flops, r.tuning_budget * result.work["calibration_pass"] - before)
        )
        budget = Budget(float("inf") if limit is None else limit, choice.work, check=result.work["heldout_pass"])
        history, steps, averaged, spent = tune(
            gated, groups, calib, recorder.targets, objective, r.epochs, seed, check, budget, r.average
        )
        gated.scales = [s.detach() for s in gated.scales]
        gated.biases = [b.detach() for b in gated.biases]
        gated.updates = [(down.detach(), up.detach()) for down, up in gated.updates]
        names = [name for name, _, _ in tunables]
        step = (", ".join(names[:-1]) + " and " if len(names) > 1 else "") + names[-1] + " tuning"
        result.work["tuning"] = spent
        if limit is not None:  # no cap, no entry
            result.work["tuning_budget"] = limit
        tuning: dict[str, Any] = {
            "step": step,
            "epochs_run": round(steps / len(calib), 2),
            "heldout_by_epoch": history,
            "seconds": round(time.perf_counter() - tick, 3),
            "flops": spent,
            "budget_flops": limit,
            "averaged": averaged,
        }
        if history and choice.values is not None:  # kept only when it beats the untuned state by more than
            tuned = gated.divergences(heldout, targets, objective)  # one standard error (not on noise)
            tuning["kept"] = one_standard_error({"untuned": choice.values, "tuned": tuned}) == "tuned"
            result.heldout["final"] = float((tuned if tuning["kept"] else choice.values).mean())
            if not tuning["kept"]:  # the chosen state again: its refitted weights never changed
                gated.scales = [torch.ones_like(s) for s in gated.scales]
                gated.biases, gated.updates = untuned, []
        result.recovery.append(tuning)
        timings["tuning"] = time.perf_counter() - tick
