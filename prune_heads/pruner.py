"""`prune_model`: the whole pruning flow in one call, the best measured path by default.

Score the heads on calibration batches (their held-out part aside), build the candidate plans, and try each
on the gated model against the unpruned outputs on the held-out part; then keep each recovery step (bias
compensation, gate, bias and projection tuning) only if it lowers that held-out divergence. Everything is tried
on the one model through gates, added biases and low-rank updates, then folded into the weights and the heads
removed.
"""

from __future__ import annotations

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

from .budgets import depth_heads, given_plan, selection_budget
from .config import PruneConfig, RecoveryConfig
from .errors import ConfigError
from .evaluation.confidence import perplexity_change
from .export.persistence import output_biases_load
from .model.layers import parameters_after, require_attention, unmeasured_long_range
from .model.onload import onload_offloaded
from .model.probe import probe_layers
from .recovery.candidates import (
    Decision,
    Trial,
    candidate_plans,
    candidates,
    choose,
    fallback,
    heldout_summary,
    unpruned_heldout,
)
from .recovery.depth import Depth, deepest_within, prefix_length, prefix_plan
from .recovery.gated import GatedModel
from .recovery.generated import token_batches, with_generated, writes_text
from .recovery.holdout import SequenceNLL, one_standard_error, sequence_nll, split_holdout
from .recovery.reconstruction import refit_flops
from .recovery.search import ROUNDS, Searched, SearchSchedule, Unit, searched_plan
from .recovery.tuning import Schedule, tune
from .runtime.devices import input_device, to_device
from .runtime.progress import progress_bar
from .runtime.work import Budget, Work
from .scoring.head_scores import HeadScores
from .scoring.iterative import prune_iteratively
from .scoring.kv_cache import fits_cache, kv_cache_size
from .scoring.methods import score_heads
from .scoring.objective import Objective, frozen
from .scoring.recording import Recorder, record
from .scoring.selection import HeadBudget, check_budget, requested_heads
from .task_data import DataError, TaskData, with_targets, without_labels

BEFORE_TUNING = ("generation", "recording", "search", "depth", "selection")  # recovery's work before tuning
MAX_LOSS_RULE = (
    "the longest prefix of the searched order whose held-out perplexity rise (point estimate), each pruned layer "
    "refitted, is at most the bound; another candidate plan or tuning is kept only where the rise stays within it"
)
FRONTIER_RULE = (
    "each depth is the prefix of one searched order (to the deepest asked) with each pruned layer refitted, "
    "before tuning; the change is the perplexity's against the unpruned model's on the same sequences, with a 95% "
    "paired bootstrap interval over them"
)
FRONTIER_CACHE_TYPES = ("f16", "q8_0")  # llama.cpp's default KV cache and its 8-bit one
logger = logging.getLogger("prune_heads")
SEARCHED = "search + reconstruction"  # the candidate whose state a loss bound measures along the searched order


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


def prune_model(
    model: nn.Module,
    data: TaskData | Iterable[dict],
    config: PruneConfig | None = None,
    progress: bool = True,
    eval_data: TaskData | Iterable[dict] | None = None,
    plan: dict | None = None,
) -> PruneResult:
    """Prune `model` in place, the whole flow in one call, and say what was done.

    `data`: a `TaskData` from `ph.load_task_data` or any iterable of batch dicts (labels optional), used for
    scoring and calibration, never the evaluation split. `config` (default `PruneConfig()`: fisher scores, half
    the heads, held-out recovery) sets scoring, selection and recovery; `PruneConfig.from_recipe` builds one
    from a recipe. The budget is checked against the model's structure before any data is read. With recovery
    on, `recovery.holdout` of the batches is held out, and every candidate plan with its recovery
    (`prune_heads.recovery.candidates`) and the tuning after it are kept only when they lower the divergence
    from the unpruned model there, so the result is never worse on held-out data than the plain selection
    (docs/recovery.md). No copy of the model is made: candidates and tuning run on the model itself through
    gates, then folded in. With `selection.depths`, each depth is measured along the searched order
    (`PruneResult.frontier`), also on `eval_data` (a second text with labels) where given. With `plan`
    (`{layer: [heads]}`, such as a frontier depth's), that plan goes with the same recovery: no scoring, no
    search, no other candidate.
    """
    config = config or PruneConfig()
    start = time.perf_counter()
    batches = _batches(data, config)
    given = None
    if plan is None:
        budget = selection_budget(model, config, _seq_len(batches))
    onload_offloaded(model)  # after the budget's check: weights offloaded to the CPU, cut there, run on the device
    if plan is not None:  # checked on the weights
        given, budget = given_plan(model, config, plan)
    asked = requested_heads(model, budget)
    batches, generated = _with_written_text(model, batches, config)
    if config.scoring.steps > 1:
        s = config.scoring
        found = prune_iteratively(model, batches, budget, s.steps, s.method, seed=s.seed, progress=progress)
        return PruneResult(found.plan, found.scores, found.history, asked=asked, seconds=time.perf_counter() - start)
    run = _start(model, batches, generated, budget, asked, config, start, progress)
    run.given = given
    run.depths, run.second = _frontier_asked(model, config, eval_data)
    scores, recorder, recorded = _score(run)
    gated = GatedModel(model, run.layers)
    with frozen(model), gated:
        pricing = _price(run, gated, recorded)
        trial = _trial(run, gated, recorder)
        run.unpruned = _heldout_nll(run, gated)
        decision = _choose(run, trial, scores, pricing)
    gated.prove(decision.plan, run.calib[0])  # before tuning, the flow's peak, so the originals can go
    if recorder is not None:
        recorder.release_moments()
        with frozen(model), gated:
            _tune(run, trial, decision, pricing)
    gated.fold(decision.plan)
    _perplexity_change(run)
    return run.result(decision.plan, scores)


def _batches(data: TaskData | Iterable[dict], config: PruneConfig) -> list[dict]:
    """The calibration batches; an encoder's labels score one-shot only (`with_targets`)."""
    batches = list(data) if config.scoring.steps > 1 else with_targets(data)
    if not batches:
        raise DataError("no calibration batches: give data with at least one example")
    return batches


def _seq_len(batches: list[dict]) -> int:
    """The first batch's sequence length, what a FLOPs budget is priced at."""
    return next((v.shape[-1] for v in batches[0].values() if torch.is_tensor(v) and v.dim() > 1), 128)


def _with_written_text(model: nn.Module, batches: list[dict], config: PruneConfig) -> tuple[list, list]:
    """The batches with the model's own written text beside them where asked (and that text alone), labels
    dropped for the label-free objective."""
    generated: list[dict] = []
    share = _generated_share(model, batches, config.recovery)  # only with recovery on, so never with steps > 1
    if share:
        batches, generated = with_generated(model, batches, share, config.scoring.seed)
    if config.scoring.objective == "label-free":
        batches = [without_labels(b) for b in batches]
    return batches, generated


def _start(
    model: nn.Module,
    batches: list,
    generated: list,
    budget: HeadBudget,
    asked: int,
    config: PruneConfig,
    start: float,
    progress: bool,
) -> Run:
    """The run: the held-out split, the attention layers (each proven to be one, on the first batch), the
    objective, and the recovery as it runs (no bias steps where the model cannot hold output biases)."""
    r = config.recovery
    calib, heldout = split_holdout(batches, r.holdout if r.enabled else 0.0)
    if config.selection.max_loss is not None and not (heldout and all("labels" in b for b in heldout)):
        raise ConfigError(
            "selection.max_loss measures the perplexity on held-out calibration examples with labels, and this "
            "data gave none: give more examples (or a shorter --max-length) for a causal-lm task"
        )
    layers = require_attention(model)
    probe_layers(model, layers, to_device(without_labels(calib[0]), input_device(model)))
    run = Run(model, config, r, budget, asked, calib, heldout, generated, layers, Objective(model), start, progress)
    if (
        r.enabled
        and (r.bias_compensation or r.bias_tuning)
        and config.selection.uniform
        and not output_biases_load(model)
    ):
        run.notes.append("no output biases added: a stock config of this model cannot hold them (uniform)")
        run.recovery = dataclasses.replace(r, bias_compensation=False, bias_tuning=False)
    return run


def _score(run: Run) -> tuple[HeadScores | None, Recorder | None, bool]:
    """The heads' scores (none for a given plan) and, for recovery, the unpruned model's statistics and outputs
    on the calibration batches (moved to the model's device, labels dropped): recorded while scoring, or in a
    no-grad pass of their own where the Gram matrices are needed (a share of the weights, not beside the
    scoring's activations). Also whether that pass ran."""
    tick, s, r = time.perf_counter(), run.config.scoring, run.recovery
    during = r.enabled and not r.reconstruction and run.given is None
    with Recorder(run.model, run.layers, run.objective) if during else nullcontext() as recorder:
        scores = (
            score_heads(
                run.model, run.calib, method=s.method, normalize=s.normalize, seed=s.seed, progress=run.progress
            )
            if run.given is None
            else None
        )
    run.calib = [to_device(without_labels(b), input_device(run.model)) for b in run.calib]
    recorded = r.enabled and (recorder is None or recorder.calls != len(run.calib))  # no plain pass per batch
    if recorded:
        recorder = record(run.model, run.calib, run.objective, r.reconstruction, run.progress)
    run.timings["scoring"] = time.perf_counter() - tick
    return scores, recorder, recorded


def _price(run: Run, gated: GatedModel, recorded: bool) -> Work:
    """The price of passes over batches of the gated model, and the counted work of the passes so far."""
    work = Work.of(gated.model, run.calib[0])
    run.work = {"calibration_pass": work.forward_backward(run.calib), "heldout_pass": work.forward(run.heldout)}
    if recorded:
        run.work["recording"] = work.forward(run.calib)
    if run.generated:  # sampled with the KV cache: a forward pass over the written tokens
        run.work["generation"] = work.forward(run.generated)
    return work


def _trial(run: Run, gated: GatedModel, recorder: Recorder | None) -> Trial:
    """What the candidates are tried with: the held-out batches on the model's device and the unpruned
    model's outputs there (and its Gram matrices, which choose each reconstruction's ridge)."""
    r = run.recovery
    heldout = [to_device(without_labels(b), input_device(run.model)) for b in run.heldout]
    reference = unpruned_heldout(gated, heldout, run.objective, r.reconstruction) if heldout else None
    bias = r.bias_tuning or r.bias_compensation
    return Trial(gated, run.objective, recorder, reference, heldout, bias, run.progress)


def _choose(run: Run, trial: Trial, scores: HeadScores | None, work: Work) -> Decision:
    """The searched plan where the search runs (with a loss bound, the depth from its order), the other
    candidate plans at that budget (a given plan alone, without scores), then the candidate kept on the
    held-out batches (with a loss bound, the searched prefix where the one kept raises the held-out perplexity
    beyond it)."""
    tick, r = time.perf_counter(), run.recovery
    searched = _search(run, trial, scores, work) if scores is not None else Searched(None, 0.0)
    if run.depths:
        run.frontier = _frontier(run, trial, searched, work)
    if run.config.selection.max_loss is not None:
        searched = _within_loss(run, trial, searched)
    elif run.depths:
        searched = _at_budget(run, searched)
    plans, notes, costed = _candidate_plans(run, trial, scores)
    run.notes += notes
    if searched.plan is not None:
        plans["search"] = searched.plan
    tried = candidates(plans, r.reconstruction, r.bias_compensation, trial.calibration is not None)
    decision = choose(trial, tried, fallback(plans, r.reconstruction, r.bias_compensation))
    if decision.label != SEARCHED and not _within_bound(run, trial):  # the searched prefix was measured within
        decision = _searched_prefix(run, trial, decision, tried)
    trial.release()
    run.notes += trial.notes + _warned(unmeasured_long_range(run.layers, decision.plan, _seq_len(run.calib)))
    run.work["reconstruction"] = trial.refit_work
    run.work["selection"] = (len(decision.tried) + 1) * run.work["heldout_pass"] + trial.refit_work + costed
    run.steps.append(decision.entry(round(time.perf_counter() - tick, 3)))
    run.summary = {**run.summary, **heldout_summary(decision, trial.batches)}
    run.timings["selection"] = time.perf_counter() - tick
    return decision


def _warned(note: str | None) -> list[str]:
    """`note` (if any) as the report's notes take it, said on the terminal too."""
    if note is not None:
        logger.warning(note)
    return [] if note is None else [note]


def _candidate_plans(run: Run, trial: Trial, scores: HeadScores | None) -> tuple[dict, list[str], float]:
    """The candidate plans at the budget, a note for each not made and their counted work (a given plan alone)."""
    r = run.recovery
    if scores is None:
        return {"given": run.given or {}}, [], 0.0
    return candidate_plans(scores, trial.calibration, run.layers, run.budget, r.rearrange, r.reconstruction)


def _search(run: Run, trial: Trial, scores: HeadScores, work: Work) -> Searched:
    """The searched plan where the search runs (`search_rounds`; by default where the outputs are per
    position) and its counted work fits in what the tuning budget has left after the passes before it (with a
    loss bound or a frontier, whatever it costs, to the deepest depth asked: the depths come from its order)."""
    r, none = run.recovery, Searched(None, 0.0)
    if not (r.rearrange and r.reconstruction and trial.calibration is not None and trial.reference is not None):
        return none
    rounds = r.search_rounds
    if rounds is None:  # the default: only where the outputs are per position
        rounds = ROUNDS if run.objective.per_position(trial.targets[0]) else 0
    if not rounds:
        return none
    spent = sum(run.work.get(k, 0.0) for k in BEFORE_TUNING)  # the writing and the recording
    limit, budget = math.inf, run.budget
    if run.depths:
        deepest = max([heads for _, heads in run.depths] + [check_budget(run.model, budget)])
        budget = dataclasses.replace(budget, sparsity=None, num_heads=deepest, round=None)
    elif r.tuning_budget is not None and run.config.selection.max_loss is None:
        limit = r.tuning_budget * run.work["calibration_pass"] - spent
    schedule = SearchSchedule(rounds, r.search_examples, r.search_screen)
    searched = searched_plan(trial, scores, budget, run.calib, schedule, work, limit)
    run.work["search"] = searched.work
    if searched.note is not None:
        run.notes.append(searched.note)
    return searched


def _within_loss(run: Run, trial: Trial, searched: Searched) -> Searched:
    """The longest prefix of the searched order whose held-out perplexity rise, each pruned layer refitted
    (before tuning), is within `selection.max_loss`: the budget becomes its heads and the searched plan that
    prefix. The rises measured go to the held-out summary (`max_loss`)."""
    percent = run.config.selection.max_loss
    if searched.plan is None or run.unpruned is None or percent is None:
        raise ConfigError(f"selection.max_loss measures along the searched order, and there is none: {searched.note}")
    bound = percent / 100

    def rise(count: int) -> float:
        _refitted(run, trial, prefix_plan(searched.order, count), "depth")
        return _rise(run, trial.gated, "depth")

    count, rises = deepest_within(len(searched.order), rise, bound)
    trial.gated.use({})
    plan = prefix_plan(searched.order, count)
    heads = sum(len(h) for h in plan.values())
    run.budget, run.asked = dataclasses.replace(run.budget, num_heads=heads, round=None), heads
    measured = [[sum(len(u) for _, u in searched.order[:k]), rises[k]] for k in sorted(rises)]
    run.summary["max_loss"] = {"bound": bound, "heads": heads, "rises": measured, "rule": MAX_LOSS_RULE}
    return dataclasses.replace(searched, plan=plan, order=searched.order[:count])


def _refitted(run: Run, trial: Trial, plan: dict[str, list[int]], work: str) -> None:
    """Put `plan` on the gated model with each pruned layer refitted, the refits counted as `work`."""
    trial.gated.use(plan, refits={name: trial.refit(name, heads) for name, heads in plan.items()})
    run.work[work] = run.work.get(work, 0.0) + refit_flops(run.layers, plan)


def _heldout_nll(run: Run, forward: Any, work: str = "perplexity") -> SequenceNLL | None:
    """A language model's next-token NLL per held-out sequence (None for other tasks), its pass counted as
    `work`."""
    if not (run.heldout and writes_text(run.model) and all("labels" in b for b in run.heldout)):
        return None
    run.work[work] = run.work.get(work, 0.0) + run.work["heldout_pass"]
    return sequence_nll(forward, run.heldout, input_device(run.model))


def _rise(run: Run, forward: Any, work: str = "perplexity") -> float:
    """The held-out perplexity's relative change from the unpruned model's under `forward`, its pass counted
    as `work`."""
    assert run.unpruned is not None
    pruned = _heldout_nll(run, forward, work)
    assert pruned is not None  # the same batches as the unpruned model's
    return math.exp(pruned.mean - run.unpruned.mean) - 1


def _within_bound(run: Run, trial: Trial) -> bool:
    """Whether the gated model's held-out perplexity rise is within `selection.max_loss` (always without one)."""
    percent = run.config.selection.max_loss
    return percent is None or _rise(run, trial.gated, "depth") <= percent / 100


def _searched_prefix(run: Run, trial: Trial, decision: Decision, tried: list) -> Decision:
    """The searched prefix with its reconstruction, the state whose rise chose the depth, in place of the
    candidate `decision` kept (the others' held-out values stay in the report)."""
    searched = [c for c in tried if c.label == SEARCHED]
    kept = choose(trial, searched, searched[0].label)
    run.notes.append(f"{decision.label} raised the held-out perplexity beyond max_loss; kept {kept.label}")
    return dataclasses.replace(kept, tried=decision.tried)


def _frontier_asked(
    model: nn.Module, config: PruneConfig, eval_data: TaskData | Iterable[dict] | None
) -> tuple[list[tuple[float, int]], list[dict]]:
    """The depths a frontier measures (share, heads) and its second text's batches (none without depths)."""
    if config.selection.depths is None:
        return [], []
    second = list(eval_data or [])
    if not all("labels" in b for b in second):
        raise DataError("the frontier's second text (eval_data) needs labels: load it as a causal-lm task")
    return list(zip(config.selection.fractions(), depth_heads(model, config))), second


def _frontier(run: Run, trial: Trial, searched: Searched, work: Work) -> list[Depth]:
    """The unpruned model (depth 0), then each asked depth measured along the searched order: its prefix, each
    pruned layer refitted, against the unpruned model on the held-out batches (and the second text), with its
    KV cache and parameters."""
    if searched.plan is None or run.unpruned is None:
        raise ConfigError(f"selection.depths measures along the searched order, and there is none: {searched.note}")
    trial.gated.use({})
    second = _second_nll(run, trial.gated, work)
    kv, parameters = _size(run, {})
    same, interval = (0.0, (0.0, 0.0)) if second is not None else (None, None)  # the unpruned model against itself
    found = [Depth(0.0, 0, 0, 0.0, (0.0, 0.0), same, interval, kv, parameters, {})]
    with progress_bar(None, "frontier", len(run.depths), run.progress) as bar:
        for share, heads in run.depths:
            count = prefix_length(searched.order, heads)
            assert count is not None  # units of one size, checked before any data
            found.append(_depth(run, trial, share, searched.order[:count], second, work))
            bar.update()
    trial.gated.use({})
    return found


def _depth(run: Run, trial: Trial, share: float, prefix: list[Unit], second: SequenceNLL | None, work: Work) -> Depth:
    """One depth: the `prefix`'s plan refitted on the gated model, measured on the held-out batches and the second
    text."""
    plan = prefix_plan(prefix, len(prefix))
    _refitted(run, trial, plan, "frontier")
    seed, heldout = run.config.scoring.seed, _heldout_nll(run, trial.gated, "frontier")
    assert run.unpruned is not None and heldout is not None  # measured where the search ran
    change, interval = perplexity_change(run.unpruned, heldout, seed)
    eval_change = eval_interval = None
    if second is not None:
        pruned = _second_nll(run, trial.gated, work)
        assert pruned is not None  # the same batches as the unpruned model's
        eval_change, eval_interval = perplexity_change(second, pruned, seed)
    heads, (kv, parameters) = sum(map(len, plan.values())), _size(run, plan)
    return Depth(share, len(prefix), heads, change, interval, eval_change, eval_interval, kv, parameters, plan)


def _size(run: Run, plan: dict[str, list[int]]) -> tuple[dict[str, int], int]:
    """The KV cache at the frontier's context per cache type the head size fits, and the parameters, once
    `plan` is removed."""
    context = run.config.selection.context
    caches = [c for c in FRONTIER_CACHE_TYPES if fits_cache(run.layers, c)]
    return {c: kv_cache_size(run.model, context, c, plan) for c in caches}, parameters_after(run.model, plan)


def _second_nll(run: Run, forward: Any, work: Work) -> SequenceNLL | None:
    """The NLL per sequence of the frontier's second text under `forward` (None without one), its pass counted
    as frontier work."""
    if not run.second:
        return None
    run.work["frontier"] = run.work.get("frontier", 0.0) + work.forward(run.second)
    return sequence_nll(forward, run.second, input_device(run.model))


def _at_budget(run: Run, searched: Searched) -> Searched:
    """The searched order's prefix that removes the budget's heads, the searched plan where the search went
    deeper for a frontier."""
    if searched.plan is None:
        return searched
    count = prefix_length(searched.order, check_budget(run.model, run.budget))
    assert count is not None  # units of one size, checked before any data
    return dataclasses.replace(searched, plan=prefix_plan(searched.order, count), order=searched.order[:count])


def _perplexity_change(run: Run) -> None:
    """The held-out perplexity's relative change from the unpruned model's, into the held-out summary."""
    if run.unpruned is not None and run.summary:
        run.summary["perplexity_change"] = _rise(run, lambda batch: run.model(**batch))


def _generated_share(model: nn.Module, batches: list[dict], r: RecoveryConfig) -> float:
    """`r.generated_share`; a share asked of a model or data that cannot take it is refused (before any
    scoring)."""
    if r.generated_share and not (writes_text(model) and token_batches(batches)):  # checked only when asked
        raise ConfigError(
            f"recovery.generated_share is {r.generated_share}, but only a decoder-only language model on batches "
            "of token ids writes its own calibration text; give 0 (or leave it out) for this model"
        )
    return r.generated_share


def _tune(run: Run, trial: Trial, decision: Decision, work: Work) -> None:
    """Tune the chosen state's gates, output biases and projection updates to the unpruned outputs, kept only
    when the held-out divergence falls by more than one standard error (and a loss bound still holds);
    bounded by `tuning_budget` when set."""
    r, gated = run.recovery, trial.gated
    if not (r.tuning and r.epochs > 0):
        return
    tick = time.perf_counter()
    untuned = [b.detach().clone() for b in gated.biases]
    rank = r.projection_rank if r.projection_tuning else None
    tunables = gated.tunables(r.gate_tuning, r.bias_tuning, rank, run.config.scoring.seed)
    rates = {"gate": r.gate_lr, "bias": r.bias_lr, "projection": r.projection_lr}
    groups = [{"params": params, "lr": rates[name]} for name, params in tunables.items()]
    check = (lambda: float(trial.divergences().mean())) if trial.batches else None
    limit = _tuning_limit(run)
    budget = Budget(float("inf") if limit is None else limit, work, check=run.work["heldout_pass"])
    assert trial.calibration is not None
    with progress_bar(None, "tuning", r.epochs * len(run.calib), run.progress) as bar:  # may stop early

        def forward(batch: dict) -> Any:
            bar.update()
            return gated(batch)

        schedule = Schedule(r.epochs, run.config.scoring.seed, r.average)
        targets = trial.calibration.targets
        history, steps, averaged, spent = tune(
            forward, groups, run.calib, targets, run.objective, schedule, check, budget
        )
    gated.freeze()
    run.work["tuning"] = spent
    if limit is not None:  # no cap, no entry
        run.work["tuning_budget"] = limit
    names = list(tunables)
    entry: dict[str, Any] = {
        "step": (", ".join(names[:-1]) + " and " if len(names) > 1 else "") + names[-1] + " tuning",
        "epochs_run": round(steps / len(run.calib), 2),
        "heldout_by_epoch": history,
        "seconds": 0.0,
        "flops": spent,
        "budget_flops": limit,
        "averaged": averaged,
    }
    if history and decision.values is not None:  # kept only when it beats the untuned state by more than
        tuned = trial.divergences()  # one standard error (not on noise)
        better = one_standard_error({"untuned": decision.values, "tuned": tuned}) == "tuned"
        entry["kept"] = better and _within_bound(run, trial)  # a loss bound holds after tuning too
        run.summary["final"] = float((tuned if entry["kept"] else decision.values).mean())
        if not entry["kept"]:
            gated.untune(untuned)
    entry["seconds"] = round(time.perf_counter() - tick, 3)
    run.steps.append(entry)
    run.timings["tuning"] = time.perf_counter() - tick


def _tuning_limit(run: Run) -> float | None:
    """The FLOPs tuning may spend: None without a `tuning_budget` (the held-out stop and `epochs` end it),
    else what the budget leaves after the recovery's work before tuning, at least `min_tuning_flops`."""
    r = run.recovery
    if r.tuning_budget is None:
        return None
    before = sum(run.work.get(k, 0.0) for k in BEFORE_TUNING)
    return max(r.min_tuning_flops, r.tuning_budget * run.work["calibration_pass"] - before)
