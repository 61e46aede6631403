"""`prune_model`: the whole pruning flow in one call, the best measured path by default.

Score the heads on calibration batches (their held-out part aside), build the candidate plans, and try each
on the gated model against the unpruned outputs on the held-out part; then keep each recovery step (bias
compensation, gate and bias tuning) only if it lowers that held-out divergence. Everything is tried on the
one model through gates and added biases, then folded into the weights and the heads removed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .config import ConfigError, PruneConfig
from .data import DataError, TaskData, batch_size, input_device, to_device, with_targets, without_labels
from .model.layers import require_attention
from .model.probe import probe_layers
from .model.surgery import PlanError
from .recovery.gated import GatedModel
from .recovery.holdout import one_standard_error, split_holdout
from .recovery.tuning import tune
from .runtime.work import Budget, Work
from .scoring.head_scores import HeadScores
from .scoring.iterative import prune_iteratively
from .scoring.methods import fluctuation, head_scores, score_heads
from .scoring.objective import Objective, frozen
from .scoring.recording import Recorder, record
from .scoring.selection import check_budget, heads_for_flops, requested_heads, select_heads


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
    scores: HeadScores, recorder: Recorder | None, layers, kwargs: dict, rearrange: bool, notes: list[str]
) -> dict[str, dict[str, list[int]]]:
    """The plans to try: the plain ranking, and with `rearrange` the Fisher-block and FLAP plans."""
    plans = {"ranked": select_heads(scores, **kwargs)}
    if not rearrange:
        return plans
    try:
        plans["interactions"] = select_heads(scores, strategy="interactions", **kwargs)
    except PlanError as error:
        notes.append(f"interactions not tried: {error}")
    variances = recorder.variances()
    groups = kwargs.get("gqa", "groups") == "groups"
    fluct = head_scores("fluctuation", layers, fluctuation(layers, variances, groups), scores.num_examples)
    plans["fluctuation"] = select_heads(fluct, **kwargs)
    return plans


def prune_model(
    model: nn.Module, data: TaskData | Iterable[dict], config: PruneConfig | None = None, progress: bool = True
) -> PruneResult:
    """Prune `model` in place, the whole flow in one call, and say what was done.

    `data`: a `TaskData` from `ph.load_task_data` or any iterable of batch dicts (labels optional), used
    for scoring and calibration, never the evaluation split. `config` (default `PruneConfig()`: fisher
    scores, half the heads, held-out recovery) sets scoring, selection and recovery; `PruneConfig.from_recipe`
    builds one from a recipe. The budget is checked against the model's structure before any data is read.
    With recovery on, `recovery.holdout` of the batches is held out: the candidate plans (the plain ranking,
    Kwon et al.'s Fisher-block rearrangement, FLAP's fluctuation) and each recovery step (bias compensation,
    gate and bias tuning with early stopping) are kept only when they lower the divergence from the unpruned
    model there, so the result is never worse on held-out data than the plain selection. No copy of the
    model is made: candidates and tuning run on the model itself through gates, then folded in.
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
    # recovery needs the unpruned model's statistics and outputs: recorded during scoring, not recomputed
    with Recorder(model, layers, objective) if r.enabled else nullcontext() as recorder:
        scores = score_heads(model, calib, method=s.method, normalize=s.normalize, seed=s.seed, progress=progress)
    device = input_device(model)
    calib = [to_device(without_labels(b), device) for b in calib]
    if recorder is not None and recorder.calls != len(calib):  # the method ran no plain pass per batch
        recorder = record(model, calib, objective)
    timings["scoring"] = time.perf_counter() - tick
    notes: list[str] = []
    plans = _candidates(scores, recorder, layers, kwargs, r.rearrange, notes)
    result = PruneResult(plan=plans["ranked"], scores=scores, asked=asked)
    gated = GatedModel(model, layers)
    with frozen(model), gated:
        plan = _decide(gated, plans, recorder, calib, heldout, objective, config, result, timings, device)
    gated.fold(plan, calib[0])
    result.plan = plan
    if notes:
        result.recovery.insert(0, {"step": "notes", "notes": notes})
    result.timings = {k: round(v, 3) for k, v in timings.items()}
    result.seconds = time.perf_counter() - start
    return result


def _decide(
    gated: GatedModel,
    plans: dict,
    recorder: Recorder | None,
    calib: list[dict],
    heldout: list[dict],
    objective: Objective,
    config: PruneConfig,
    result: PruneResult,
    timings: dict,
    device,
) -> dict:
    """Choose the plan, bias compensation and tuning on the held-out batches; leave `gated` in the chosen
    state and return the plan. The work is counted in FLOPs (`result.work`) and bounds the tuning."""
    r, seed = config.recovery, config.scoring.seed
    tick = time.perf_counter()
    heldout = [to_device(without_labels(b), device) for b in heldout]
    work = Work.of(gated.model, calib[0])
    result.work = {"calibration_pass": work.forward_backward(calib), "heldout_pass": work.forward(heldout)}
    with torch.no_grad():
        gated.use({})
        targets = [objective.reference(gated(b), b) for b in heldout]

    def divergences(plan: dict, biases: dict | None) -> torch.Tensor | None:
        gated.use(plan, biases)
        return gated.divergences(heldout, targets, objective) if heldout else None

    means = recorder.means() if r.bias_compensation else None
    tried = {}  # name -> (per-example held-out divergences, plan, added biases), in order of preference
    for name, plan in plans.items():
        tried[name] = (divergences(plan, None), plan, None)
        if r.bias_compensation:
            biases = gated.compensation(plan, means)
            tried[f"{name} + bias compensation"] = (divergences(plan, biases), plan, biases)
    if heldout:
        chosen = one_standard_error({k: v[0] for k, v in tried.items()})
    else:  # nothing to check against: every enabled step, as configured
        chosen = ("interactions" if "interactions" in plans else "ranked") + (
            " + bias compensation" if r.bias_compensation else ""
        )
    values, plan, biases = tried[chosen]
    value = None if values is None else float(values.mean())
    result.work["selection"] = (len(tried) + 1) * result.work["heldout_pass"]  # + the unpruned targets
    result.recovery.append(
        {
            "step": "selection",
            "kept": chosen,
            "seconds": round(time.perf_counter() - tick, 3),
            "tried": {k: None if v[0] is None else float(v[0].mean()) for k, v in tried.items()},
        }
    )
    result.heldout = {
        "batches": len(heldout),
        "examples": sum(batch_size(b) for b in heldout),
        "plain": result.recovery[-1]["tried"]["ranked"],
        "selected": value,
    }
    timings["selection"] = time.perf_counter() - tick
    gated.use(plan, biases)
    if (r.gate_tuning or r.bias_tuning) and r.epochs > 0:
        tick = time.perf_counter()
        gated.scales = [s.requires_grad_(r.gate_tuning) for s in gated.scales]
        gated.biases = [b.requires_grad_(r.bias_tuning) for b in gated.biases]
        groups = ([{"params": gated.scales, "lr": r.gate_lr}] if r.gate_tuning else []) + (
            [{"params": gated.biases, "lr": r.bias_lr}] if r.bias_tuning else []
        )
        check = (lambda: float(gated.divergences(heldout, targets, objective).mean())) if heldout else None
        limit = (
            float("inf")
            if r.tuning_budget is None
            else max(r.min_tuning_flops, r.tuning_budget * result.work["calibration_pass"] - result.work["selection"])
        )
        budget = Budget(limit, work, check=result.work["heldout_pass"])
        history, steps, averaged, spent = tune(
            gated, groups, calib, recorder.targets, objective, r.epochs, seed, check, budget, r.average
        )
        gated.scales = [s.detach() for s in gated.scales]
        gated.biases = [b.detach() for b in gated.biases]
        step = (
            "gate and bias tuning"
            if r.gate_tuning and r.bias_tuning
            else "gate tuning"
            if r.gate_tuning
            else "bias tuning"
        )
        result.work.update(tuning=spent, tuning_budget=limit)
        entry = {
            "step": step,
            "epochs_run": round(steps / len(calib), 2),
            "heldout_by_epoch": history,
            "seconds": round(time.perf_counter() - tick, 3),
            "flops": spent,
            "budget_flops": None if r.tuning_budget is None else limit,
            "averaged": averaged,
        }
        if history:  # kept only when it beats the untuned state by more than one standard error (not on noise)
            tuned = gated.divergences(heldout, targets, objective)
            entry["kept"] = one_standard_error({"untuned": values, "tuned": tuned}) == "tuned"
            value = float((tuned if entry["kept"] else values).mean())
            if not entry["kept"]:
                gated.use(plan, biases)
        result.recovery.append(entry)
        timings["tuning"] = time.perf_counter() - tick
    result.heldout["final"] = value
    return plan
