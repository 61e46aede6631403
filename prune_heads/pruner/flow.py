"""`prune_model`: the whole pruning flow in one call, the best measured path by default.

Score the heads on calibration batches (their held-out part aside), build the candidate plans, and try each
on the gated model against the unpruned outputs on the held-out part; then keep each recovery step (bias
compensation, gate, bias and projection tuning) only if it lowers that held-out divergence. Everything is tried
on the one model through gates, added biases and low-rank updates, then folded into the weights and the heads
removed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ..budgets import Budget, resolve_budget
from ..config import ROUNDS, PruneConfig, RecoveryConfig
from ..errors import ConfigError
from ..export.persistence import output_biases_load
from ..model.layers import require_attention, unmeasured_long_range
from ..model.onload import layer_major_chain, moved_bytes, offloaded_bytes, onload_offloaded, prove_layer_major
from ..model.probe import probe_layers
from ..recovery.candidates import (
    Candidate,
    Step,
    Trial,
    candidate_plans,
    candidates,
    choose,
    fallback,
    heldout_summary,
    unpruned_heldout,
)
from ..recovery.gated import GatedModel
from ..recovery.general import General, general_text
from ..recovery.generated import token_batches, with_generated, writes_text
from ..recovery.holdout import one_standard_error, split_holdout
from ..recovery.prefixes import prefix_plan, ranked_order
from ..recovery.search import Searched, SearchSchedule, searched_plan
from ..recovery.tuning import Schedule, tune
from ..runtime.devices import input_device, to_device
from ..runtime.ledger import BEFORE_TUNING, Stage, Tally
from ..runtime.parallel import any_across, check_shares, is_main, rank_and_size, same_everywhere
from ..runtime.progress import progress_bar
from ..runtime.work import Pricer, WorkLimit
from ..scoring.head_scores import HeadScores
from ..scoring.methods import score_heads, scoring_passes
from ..scoring.objective import Objective, frozen
from ..scoring.recording import Recorder, record
from ..scoring.selection import HeadBudget, check_budget
from ..task_data import DataError, TaskData, batch_size, with_targets, without_labels
from .depths import at_budget, frontier, frontier_text, searched_prefix, within_bound, within_loss
from .healing import Healed, heal, heal_start
from .records import Bench, Chosen, PruneResult, Run, Scored, Tuned, general_rise, heldout_nll, logger, rise
from .sharing_candidates import given_sharing, shared_candidates


def prune_model(
    model: nn.Module,
    data: TaskData | Iterable[dict],
    config: PruneConfig | None = None,
    progress: bool = True,
    eval_data: TaskData | Iterable[dict] | None = None,
    plan: dict | None = None,
    heal_data: TaskData | Iterable[dict] | None = None,
    resume: bool = False,
) -> PruneResult:
    """Prune `model` in place, the whole flow in one call, and say what was done.

    `data`: a `TaskData` from `ph.load_task_data` or any iterable of batch dicts (labels optional), used for
    scoring and calibration, never the evaluation split. `config` (default `PruneConfig()`: fisher scores, half
    the heads, held-out recovery) sets scoring, selection and recovery; `PruneConfig.from_recipe` builds one
    from a recipe. The budget is checked against the model's structure before any data is read. With recovery
    on, `recovery.holdout` of the batches is held out, and every candidate plan with its recovery
    (`prune_heads.recovery.candidates`) and the tuning after it are kept only when they lower the divergence
    from the unpruned model there, so the result is never worse on held-out data than the plain selection
    (docs/recovery.md). A second held-out set (the general-ability guard, docs/general-ability.md), `eval_data`
    (with labels) where given, else for a language model text it writes itself, is reported on
    (`recovery.general` 'report'), also weighed equally by every such decision ('weigh'), or left out ('off').
    No copy of the model is made: candidates and tuning run on the model itself through gates, then folded in.
    With `selection.depths`, each depth is measured along the searched order (`PruneResult.frontier`), also on
    that second set, and with KV heads shared too where the run shares them. With `plan` (`{layer: [heads]}`,
    such as a frontier depth's, or a result's `written_plan` with the KV heads it shares), that plan goes with
    the same recovery: no scoring, no search, no other plan. With `recovery.heal` tokens, the pruned model is
    then distilled toward a copy of the unpruned one on the calibration text and, for a language model, text
    it writes itself (`heal_data`'s batches in its place where given), kept only where held-out data improves;
    `resume` continues the heal from the checkpoints in `recovery.heal_checkpoints` (docs/recovery.md).
    Iterative pruning (`scoring.steps > 1`) is `ph.prune_iteratively`'s.
    """
    run = _start(model, data, config or PruneConfig(), progress, eval_data, plan, heal_data, resume)
    scored = _score(run)
    gated = GatedModel(model, run.layers)
    with frozen(model), gated:
        bench = _bench(run, gated, scored)
        chosen = _choose(run, bench, scored.scores)
    gated.prove(chosen.decision.plan, run.calib[0])  # before tuning, the flow's peak, so the originals can go
    tuned = None
    if scored.recorder is not None:
        scored.recorder.release_moments()
        with frozen(model), gated:
            tuned = _tune(run, bench, chosen)
    gated.fold(chosen.decision.plan)
    healed = heal(run, bench, run.heal) if run.heal is not None else None
    return _result(run, bench, scored, chosen, tuned, healed)


def _start(
    model: nn.Module,
    data: TaskData | Iterable[dict],
    config: PruneConfig,
    progress: bool,
    eval_data: TaskData | Iterable[dict] | None,
    plan: dict | None,
    heal_data: TaskData | Iterable[dict] | None,
    resume: bool,
) -> Run:
    """The run: the budget (checked against the structure before any data), the model's written text beside
    the batches where asked, the held-out split, the attention layers (each proven to be one, on the first
    batch), the objective, the recovery it runs (no bias steps where the model cannot hold output biases) and
    the heal's teacher (its checkpoints checked)."""
    start, progress = time.perf_counter(), progress and is_main()  # data-parallel: the first process's bars
    if config.scoring.steps > 1:
        raise ConfigError(
            "scoring.steps > 1 prunes iteratively, which is ph.prune_iteratively's path (prune-heads prune --steps "
            "runs it); give prune_model scoring.steps 1"
        )
    batches = _batches(data)
    budget = _budget(model, config, batches, plan)
    healing = heal_start(model, config, batches, heal_data, resume, progress)
    batches, generated = _with_written_text(model, batches, config)
    config, notes = _runnable(model, config)
    r = config.recovery
    calib, heldout = split_holdout(batches, r.holdout if r.enabled else 0.0)
    general, off = _general(model, config, calib, heldout, eval_data, progress)
    second = general.heldout if general is not None and config.selection.depths else frontier_text(config, eval_data)
    _check_bound(config, heldout)
    _check_processes(model, config, [calib, heldout] + ([general.heldout, general.search] if general else []))
    layers = require_attention(model)
    on_device = [to_device(without_labels(b), input_device(model)) for b in calib]
    probe_layers(model, layers, on_device[0])
    moved = moved_bytes(model)  # before the proof, which is this run's work
    prove_layer_major(model, on_device[0])  # an onloaded model's no-grad passes: each block moved once
    pricer = Pricer.of(model, on_device[0])
    written = generated + (general.written if general is not None else [])
    return Run(
        model=model,
        config=config,
        budget=budget,
        scoring=calib,
        calib=on_device,
        heldout=heldout,
        generated=generated,
        layers=layers,
        objective=Objective(model),
        start=start,
        progress=progress,
        second=second,
        general=general,
        notes=notes + off,
        moved=moved,
        offloaded=offloaded_bytes(model),
        heal=healing,
        pricer=pricer,
        work=_start_work(model, pricer, written, on_device[0]),
    )


def _start_work(model: nn.Module, pricer: Pricer, written: list[dict], first: dict) -> dict[Stage, float]:
    """The start's counted work: the text written beside the batches and the guard's (sampled with the KV cache:
    a forward pass over the written tokens) and, where layers run one at a time, their proof (a whole pass and
    two layer-major ones over the first batch)."""
    work = {Stage.GENERATION: pricer.forward(written)} if written else {}
    if layer_major_chain(model) is not None:
        work[Stage.RECORDING] = 3 * pricer.forward([first])
    return work


def _check_bound(config: PruneConfig, heldout: list[dict]) -> None:
    """A loss bound measures the loss on held-out examples with labels: refused where the data gave none."""
    if config.selection.max_loss is not None and not (heldout and all("labels" in b for b in heldout)):
        raise ConfigError(
            "selection.max_loss measures the loss on held-out calibration examples with labels, and this data gave "
            "none: give more examples (or a shorter --max-length for a causal-lm task), with their labels"
        )


def _check_processes(model: nn.Module, config: PruneConfig, lists: list[list[dict]]) -> None:
    """Data-parallel, before scoring: every process holds calibration rows and runs the same model, config
    and batches (else their decisions would part)."""
    check_shares(lists[0], "calibration")
    shapes = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    same_everywhere(repr((shapes, config)), [b for batches in lists for b in batches])


def _batches(data: TaskData | Iterable[dict]) -> list[dict]:
    """The calibration batches; an encoder's labels score one-shot only (`with_targets`)."""
    batches = with_targets(data)
    if not batches:
        raise DataError("no calibration batches: give data with at least one example")
    return batches


def _budget(model: nn.Module, config: PruneConfig, batches: list[dict], plan: dict | None) -> Budget:
    """The budget, checked against the model's structure before any data is read: a plan given whole once any
    offloaded weights are onloaded (it is checked on the weights), any other budget before."""
    if plan is None:
        budget = resolve_budget(model, config, _seq_len(batches))
        onload_offloaded(model)  # weights offloaded to the CPU are cut there and run on the device
        return budget
    onload_offloaded(model)
    return resolve_budget(model, config, plan=plan)


def _runnable(model: nn.Module, config: PruneConfig) -> tuple[PruneConfig, tuple[str, ...]]:
    """`config` as this model can run it, with a note for what it leaves out: no output biases where a stock
    config of the model cannot hold them (a uniform plan)."""
    r = config.recovery
    if not (r.enabled and (r.bias_compensation or r.bias_tuning) and config.selection.uniform):
        return config, ()
    if output_biases_load(model):
        return config, ()
    recovery = dataclasses.replace(r, bias_compensation=False, bias_tuning=False)
    note = "no output biases added: a stock config of this model cannot hold them (uniform)"
    return dataclasses.replace(config, recovery=recovery), (note,)


def _seq_len(batches: list[dict]) -> int:
    """The first batch's sequence length, what a FLOPs budget is priced at."""
    return next((v.shape[-1] for v in batches[0].values() if torch.is_tensor(v) and v.dim() > 1), 128)


def _with_written_text(model: nn.Module, batches: list[dict], config: PruneConfig) -> tuple[list, list]:
    """The batches with the model's own written text beside them where asked (and that text alone), labels
    dropped for the label-free objective."""
    generated: list[dict] = []
    share = _generated_share(model, batches, config.recovery)
    if share:
        batches, generated = with_generated(model, batches, share, config.scoring.seed)
    if config.scoring.objective == "label-free":
        batches = [without_labels(b) for b in batches]
    return batches, generated


def _general(
    model: nn.Module,
    config: PruneConfig,
    calib: list[dict],
    heldout: list[dict],
    eval_data: TaskData | Iterable[dict] | None,
    progress: bool,
) -> tuple[General | None, tuple[str, ...]]:
    """The general-ability guard's text where decisions are made on held-out data and the config does not say
    the model serves its calibration's domain alone (`recovery.general` 'off'), with a note where there is none."""
    r = config.recovery
    if not (r.enabled and heldout) or r.general == "off":
        return None, ()
    searched = r.search_examples if r.general == "weigh" else 0  # a report needs no text beside the search
    general, note = general_text(model, calib, heldout, eval_data, searched, config.scoring.seed, progress)
    if note is not None:
        logger.info(note)
    return general, () if note is None else (note,)


def _score(run: Run) -> Scored:
    """The heads' scores (none for a given plan) and, for recovery, the unpruned model's statistics and outputs
    on the calibration batches: recorded while scoring, or in a no-grad pass of their own where the Gram
    matrices are needed (a share of the weights, not beside the scoring's activations)."""
    tick, s, r = time.perf_counter(), run.config.scoring, run.config.recovery
    single = rank_and_size()[1] == 1  # data-parallel scoring takes whole batches, recording each batch's rows
    during = r.enabled and not r.reconstruction and run.budget.given is None and single
    with Recorder(run.model, run.layers, run.objective) if during else nullcontext() as recorder:
        scores = (
            score_heads(
                run.model, run.scoring, method=s.method, normalize=s.normalize, seed=s.seed, progress=run.progress
            )
            if run.budget.given is None
            else None
        )
    work: dict[Stage, float] = {}
    if scores is not None:
        work[Stage.SCORING] = scoring_passes(s.method, run.layers) * run.pricer.forward(run.calib)
    if r.enabled and (recorder is None or recorder.calls != len(run.calib)):  # no plain pass per batch
        recorder = record(run.model, run.calib, run.objective, r.reconstruction, run.progress)
        work[Stage.RECORDING] = run.pricer.forward(run.calib)
    return Scored(scores, recorder, work, time.perf_counter() - tick)


def _bench(run: Run, gated: GatedModel, scored: Scored) -> Bench:
    """What the decisions are measured on: the price of passes, the work of the passes so far, the held-out
    batches on the model's device with the unpruned model's outputs there (and its Gram matrices, which choose
    each reconstruction's ridge) and its held-out NLL."""
    general = run.general.heldout if run.general is not None else []
    weighed = general if run.weighs_general else []
    tally = Tally(run.pricer.forward_backward(run.calib), run.pricer.forward(run.heldout + weighed))
    for stage, flops in [*scored.work.items(), *run.work.items()]:  # counted where each was spent
        tally.add(stage, flops)
    r = run.config.recovery
    heldout = [to_device(without_labels(b), input_device(run.model)) for b in run.heldout + weighed]
    reference = unpruned_heldout(gated, heldout, run.objective, r.reconstruction) if heldout else None
    bias = r.bias_tuning or r.bias_compensation
    domain = sum(batch_size(b) for b in run.heldout) if weighed else None
    trial = Trial(gated, run.objective, scored.recorder, reference, heldout, bias, run.progress, domain)
    unpruned = heldout_nll(run, tally, gated)
    return Bench(trial, tally, unpruned, heldout_nll(run, tally, gated, batches=general))


def _choose(run: Run, bench: Bench, scores: HeadScores | None) -> Chosen:
    """The searched plan where the search runs (with a loss bound, the depth from its order), the other
    candidate plans at that budget (a given plan alone, without scores), then the candidate kept on the
    held-out batches (with a loss bound, the searched prefix where the one kept raises the held-out perplexity
    beyond it)."""
    tick, r, trial = time.perf_counter(), run.config.recovery, bench.trial
    searched = _search(run, bench, scores) if scores is not None else Searched(None, 0.0)
    notes = [] if searched.note is None else [searched.note]
    found, recorded = frontier(run, bench, searched) if run.budget.depths else ([], None)
    budget, summary = run.budget.heads, {}
    if run.config.selection.max_loss is not None:
        searched, summary["max_loss"], recorded = within_loss(run, bench, searched, recorded)
        budget = dataclasses.replace(budget, num_heads=summary["max_loss"]["heads"], round=None)
    elif run.budget.depths:
        searched = at_budget(run, searched)
    plans, made, costed = _candidate_plans(run, trial, scores, budget)
    notes += made
    if searched.plan is not None:
        plans[searched.name] = searched.plan
    tried = candidates(plans, r.reconstruction, r.bias_compensation, trial.calibration is not None)
    tried = given_sharing(run, bench, tried)
    name = searched.name if searched.plan is not None else next(iter(plans))
    shared, why = shared_candidates(run, bench, name, plans[name], recorded)
    tried += shared
    notes += why
    decision = choose(trial, tried, fallback(plans, r.reconstruction, r.bias_compensation))
    bench.tally.add(Stage.RECONSTRUCTION, decision.work)
    measured = _bound_state(searched, tried, summary)
    if measured is not None and decision.label != measured.label and not within_bound(run, bench):
        kept = searched_prefix(trial, decision, measured)
        bench.tally.add(Stage.RECONSTRUCTION, kept.work)
        notes.append(f"{decision.label} raised the held-out perplexity beyond max_loss; kept {kept.label}")
        decision = kept
    trial.release()
    notes += _warned(*decision.notes, unmeasured_long_range(run.layers, decision.plan, _seq_len(run.calib)))
    bench.tally.add(Stage.SELECTION, (len(decision.tried) + 1) * bench.tally.heldout_pass + costed)
    summary.update(heldout_summary(decision, run.heldout))
    asked = run.budget.asked if "max_loss" not in summary else summary["max_loss"]["heads"]
    return Chosen(decision, budget, asked, found, notes, summary, time.perf_counter() - tick)


def _bound_state(searched: Searched, tried: list[Candidate], summary: dict[str, Any]) -> Candidate | None:
    """The state whose rise a loss bound measured at its depth: the searched plan refitted, or with the KV heads
    it shared there (None without a loss bound)."""
    if "max_loss" not in summary or searched.plan is None:
        return None
    sharing = summary["max_loss"].get("shared_kv_heads")
    found = [c for c in tried if sharing and c.name.startswith(searched.name) and c.sharing == sharing]
    return found[0] if found else Candidate(searched.name, searched.plan, Step.RECONSTRUCTION)


def _warned(*notes: str | None) -> list[str]:
    """The `notes` given (None: none) as the report's notes take them, said on the terminal too."""
    found = [note for note in notes if note is not None]
    for note in found:
        logger.warning(note)
    return found


def _candidate_plans(
    run: Run, trial: Trial, scores: HeadScores | None, budget: HeadBudget
) -> tuple[dict, list[str], float]:
    """The candidate plans at `budget`, a note for each not made and their counted work (a given plan alone)."""
    r = run.config.recovery
    if run.budget.given is not None:
        return {"given": run.budget.given}, [], 0.0
    assert scores is not None  # scored wherever no plan was given
    return candidate_plans(scores, trial.calibration, run.layers, budget, r.rearrange, r.reconstruction)


def _search(run: Run, bench: Bench, scores: HeadScores) -> Searched:
    """The searched plan where the search runs (`search_rounds`; by default where the outputs are per
    position) and its counted work fits in what the tuning budget has left after the passes before it (with a
    loss bound or a frontier, whatever it costs, to the deepest depth asked: the depths come from its order).
    Where it does not run and depths are measured, the plain ranking's order in its place."""
    r, budget, tally = run.config.recovery, run.budget.order, bench.tally
    rounds = _rounds(run, bench.trial)
    if not rounds:
        return _ranked(run, scores, budget)
    limit = math.inf
    if not run.budget.depths and r.tuning_budget is not None and run.config.selection.max_loss is None:
        limit = r.tuning_budget * tally.calibration_pass - tally.spent(BEFORE_TUNING)  # the writing and recording
    schedule = SearchSchedule(rounds, r.search_examples, r.search_screen)
    beside = _beside(run)
    searched = searched_plan(bench.trial, scores, budget, run.calib, schedule, run.pricer, limit, beside)
    tally.add(Stage.SEARCH, searched.work)
    return searched


def _beside(run: Run) -> list[dict] | None:
    """The guard's batches the search measures beside its calibration batches, on the model's device (None
    without a guard)."""
    if run.general is None or not run.general.search or not run.weighs_general:
        return None
    return [to_device(without_labels(b), input_device(run.model)) for b in run.general.search]


def _rounds(run: Run, trial: Trial) -> int:
    """The search's rounds: `search_rounds`, by default 2 where the outputs are per position (a language model's
    tokens), else none; none without the rearrangement, the refits and held-out batches it needs."""
    r = run.config.recovery
    if not (r.rearrange and r.reconstruction and trial.calibration is not None and trial.reference is not None):
        return 0
    if r.search_rounds is None:
        held = [t for t in trial.targets if t is not None]  # data-parallel: this process's, so asked of all
        return ROUNDS if any_across(any(map(run.objective.per_position, held))) else 0
    return r.search_rounds


def _ranked(run: Run, scores: HeadScores, budget: HeadBudget) -> Searched:
    """The plain ranking as the nested order the depths are measured along, where a loss bound or a frontier
    asks for depths and no search ran (none otherwise)."""
    if not (run.budget.depths or run.config.selection.max_loss is not None):
        return Searched(None, 0.0)
    order = ranked_order(scores, budget, check_budget(run.model, budget))
    note = "depths measured along the plain ranking's order (no search ran)"
    return Searched(prefix_plan(order, len(order)), 0.0, note, order, "ranked")


def _result(
    run: Run, bench: Bench, scored: Scored, chosen: Chosen, tuned: Tuned | None, healed: Healed | None
) -> PruneResult:
    """What the run did, once the plan is removed (and healed): its steps and notes, the held-out summary with
    the perplexity's change (a language model's), the counted work closed into its ledger, seconds per stage."""
    summary = dict(chosen.summary)
    if tuned is not None and tuned.final is not None:
        summary["final"] = tuned.final
    if healed is not None and healed.kept and "calibration" in healed.entry["heldout"]:
        summary["final"] = healed.entry["heldout"]["calibration"]["after"]
    if bench.unpruned is not None and summary:
        summary["perplexity_change"] = rise(run, bench, lambda batch: run.model(**batch))
    if run.general is not None and summary:
        examples = sum(map(batch_size, run.general.heldout))
        summary["general"] = {"source": run.general.source, "examples": examples}
        if run.weighs_general:  # else measured and reported only
            summary["general"]["weighed"] = True
        if bench.general is not None:
            summary["general_perplexity_change"] = general_rise(run, bench, lambda batch: run.model(**batch))
    notes = [*run.notes, *chosen.notes]
    steps = [chosen.decision.entry(round(chosen.seconds, 3))] + ([tuned.entry] if tuned is not None else [])
    steps += [healed.entry] if healed is not None else []
    timings = {"scoring": scored.seconds, "selection": chosen.seconds}
    if tuned is not None:
        timings["tuning"] = tuned.seconds
    if healed is not None:
        timings["healing"] = healed.seconds
    return PruneResult(
        chosen.decision.plan,
        scored.scores,
        recovery=[{"step": "notes", "notes": notes}, *steps] if notes else steps,
        heldout=summary,
        asked=chosen.asked,
        seconds=time.perf_counter() - run.start,
        timings={k: round(v, 3) for k, v in timings.items()},
        work=bench.tally.ledger(
            tuned.limit if tuned is not None else None, moved_bytes(run.model) - run.moved, run.offloaded
        ),
        frontier=chosen.frontier,
        sharing=chosen.decision.sharing,
    )


def _generated_share(model: nn.Module, batches: list[dict], r: RecoveryConfig) -> float:
    """`r.generated_share`; a share asked of a model or data that cannot take it is refused (before any
    scoring)."""
    if r.generated_share and not (writes_text(model) and token_batches(batches)):  # checked only when asked
        raise ConfigError(
            f"recovery.generated_share is {r.generated_share}, but only a decoder-only language model on batches "
            "of token ids writes its own calibration text; give 0 (or leave it out) for this model"
        )
    return r.generated_share


def _tune(run: Run, bench: Bench, chosen: Chosen) -> Tuned | None:
    """Tune the chosen state's gates, output biases and projection updates to the unpruned outputs, kept only
    when the held-out divergence falls by more than one standard error (and a loss bound still holds);
    bounded by `tuning_budget` when set. None where tuning is off."""
    r, trial, decision = run.config.recovery, bench.trial, chosen.decision
    if not (r.tuning and r.epochs > 0):
        return None
    tick, gated = time.perf_counter(), trial.gated
    untuned = [b.detach().clone() for b in gated.biases]
    rank = r.projection_rank if r.projection_tuning else None
    tunables = gated.tunables(r.gate_tuning, r.bias_tuning, rank, run.config.scoring.seed)
    rates = {"gate": r.gate_lr, "bias": r.bias_lr, "projection": r.projection_lr}
    groups = [{"params": params, "lr": rates[name]} for name, params in tunables.items()]
    check = (lambda: float(trial.divergences().mean())) if trial.batches else None
    limit = _tuning_limit(run, bench.tally)
    work_limit = WorkLimit(float("inf") if limit is None else limit, run.pricer, check=bench.tally.heldout_pass)
    assert trial.calibration is not None
    with progress_bar(None, "tuning", r.epochs * len(run.calib), run.progress) as bar:  # may stop early

        def forward(batch: dict) -> Any:
            bar.update()
            return gated(batch)

        schedule = Schedule(r.epochs, run.config.scoring.seed, r.average)
        targets = trial.calibration.targets
        history, steps, averaged, spent = tune(
            forward, groups, run.calib, targets, run.objective, schedule, check, work_limit
        )
    gated.freeze()
    bench.tally.add(Stage.TUNING, spent)
    names = list(tunables)
    entry: dict[str, Any] = {
        "step": (", ".join(names[:-1]) + " and " if len(names) > 1 else "") + names[-1] + " tuning",
        "epochs_run": round(steps / len(run.calib), 2),
        "heldout_by_epoch": history,
        "flops": spent,
        "budget_flops": limit,
        "averaged": averaged,
    }
    final = None
    if history and decision.values is not None:  # kept only when it beats the untuned state by more than
        tuned = trial.divergences()  # one standard error (not on noise)
        better = one_standard_error({"untuned": decision.values, "tuned": tuned}) == "tuned"
        entry["kept"] = better and within_bound(run, bench)  # a loss bound holds after tuning too
        final = float((tuned if entry["kept"] else decision.values).mean())
        if not entry["kept"]:
            gated.untune(untuned)
    seconds = time.perf_counter() - tick
    entry["seconds"] = round(seconds, 3)
    return Tuned(entry, final, limit, seconds)


def _tuning_limit(run: Run, tally: Tally) -> float | None:
    """The FLOPs tuning may spend: None without a `tuning_budget` (the held-out stop and `epochs` end it),
    else what the budget leaves after the recovery's work before tuning, at least `min_tuning_flops`."""
    r = run.config.recovery
    if r.tuning_budget is None:
        return None
    return max(r.min_tuning_flops, r.tuning_budget * tally.calibration_pass - tally.spent(BEFORE_TUNING))
