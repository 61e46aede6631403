"""The KV heads a run shares in place of removing whole KV groups (docs/recovery.md): whether it tries, the
candidates that keep the query heads of the groups a plan empties (the same cache), a plan given whole's sharing
on every candidate, and the layers of a plan that fit better shared, each sharing's statistics recorded on the
unpruned model with their passes counted."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..model.kv_sharing import Merges, why_not_shared
from ..recovery.candidates import Candidate, Step, Trial
from ..recovery.sharing_statistics import SharedStatistics, sharable
from ..runtime.ledger import Stage
from .records import Bench, Run


def run_cannot_share(run: Run, trial: Trial) -> str | None:
    """Why no sharing is tried: "" where none was asked (neither a KV-cache budget nor a loss bound, a plan given
    whole, no recovery, or `kv_sharing` off; a loss bound on a model that cannot share), else the reason the
    run's notes give; None where it is tried."""
    r, selection = run.config.recovery, run.config.selection
    cache = selection.kv_cache is not None
    if not (r.enabled and r.kv_sharing and (cache or selection.max_loss is not None) and run.budget.given is None):
        return ""
    why = _unshared(run, trial)
    return "" if why is not None and not cache else why  # a loss bound shares where it can, silently


def _unshared(run: Run, trial: Trial) -> str | None:
    """Why this run's model and recovery cannot share KV heads (None where they can)."""
    if not (run.config.recovery.reconstruction and trial.calibration is not None and trial.batches):
        return "sharing is tried with each layer refitted on held-out data (recovery with reconstruction)"
    if run.config.selection.uniform:
        return "a uniform plan keeps the same heads in every layer"
    if not sharable(run.layers):
        return next(w for w in map(why_not_shared, run.layers) if w is not None)
    return None


def shared_candidates(
    run: Run, bench: Bench, name: str, plan: dict[str, list[int]], earlier: SharedStatistics | None
) -> tuple[list[Candidate], list[str]]:
    """Under a KV-cache budget or a loss bound with `kv_sharing`, the candidates that keep the query heads of the
    KV groups `plan` empties, re-pointed to KV heads it keeps (the same cache): in every layer whose cut allows
    it, and in those whose refit fits better so than with the heads removed; with a note where none can. Each
    carries the statistics recorded for `plan` (`earlier`'s where they were recorded for it)."""
    why = run_cannot_share(run, bench.trial)
    if why is not None:
        return [], [] if why == "" else [f"KV heads not shared: {why}"]
    statistics = recorded_sharing(run, bench, plan, Stage.RECORDING, earlier)
    every = statistics.merges
    if not every:
        none = "KV heads not shared: the plan empties no KV group where its query heads divide over those kept"
        return [], [none] if run.config.selection.kv_cache is not None else []
    better = shared_where_better(bench, plan, statistics, Stage.RECONSTRUCTION)
    found = [Candidate(f"{name}, shared", without(plan, every), Step.RECONSTRUCTION, dict(every), statistics)]
    if better and better != every:
        found.append(Candidate(f"{name}, mixed", without(plan, better), Step.RECONSTRUCTION, better, statistics))
    return found, []


def shared_where_better(
    bench: Bench, plan: dict[str, list[int]], statistics: SharedStatistics, stage: Stage
) -> dict[str, Merges]:
    """The layers of `plan` whose refit fits better with the query heads of the KV groups it empties kept and
    shared than with them removed (the 'mixed' candidate's sharing; `statistics`: those recorded for `plan`), the
    refits counted for `stage`."""
    if not statistics.merges:
        return {}
    better, work = bench.trial.better_shared(plan, statistics)
    bench.tally.add(stage, work)
    return better


def put_shared(
    bench: Bench, plan: dict[str, list[int]], sharing: dict[str, Merges], statistics: SharedStatistics, stage: Stage
) -> dict[str, list[int]]:
    """Put `plan` on the gated model with `sharing` in place of its cut in those layers, every cut layer refitted
    (from `statistics`, those recorded for `plan`; the refits counted for `stage`), and return the heads it still
    removes."""
    trial, removed = bench.trial, without(plan, sharing)
    state = trial.state(Candidate("shared", removed, Step.RECONSTRUCTION, sharing, statistics))
    bench.tally.add(stage, state.work)
    trial.use(state)
    return removed


def given_sharing(run: Run, bench: Bench, tried: list[Candidate]) -> list[Candidate]:
    """With a plan given whole that shares KV heads, each candidate shares them, with the key maps and the
    re-pointed heads' statistics recorded where recovery runs (without it, the keys are read as they are)."""
    shared, trial = run.budget.shared, bench.trial
    if not shared:
        return tried
    statistics = None
    if run.config.recovery.enabled:
        statistics = _recorded(
            run,
            bench,
            Stage.RECORDING,
            lambda: SharedStatistics.given(run.model, trial.gated, shared, run.calib, trial.batches),
        )
    return [dataclasses.replace(candidate, sharing=shared, statistics=statistics) for candidate in tried]


def without(plan: dict[str, list[int]], sharing: dict[str, Any]) -> dict[str, list[int]]:
    """`plan` without the layers `sharing` cuts instead."""
    return {name: heads for name, heads in plan.items() if name not in sharing}


def recorded_sharing(
    run: Run, bench: Bench, plan: dict[str, list[int]], stage: Stage, earlier: SharedStatistics | None
) -> SharedStatistics:
    """The statistics of sharing in each layer `plan` empties a KV group of: `earlier`, where they were recorded
    for `plan` (a loss bound's or a frontier's depth that the candidates try again), else recorded now."""
    if earlier is not None and earlier.plan == plan:
        return earlier
    trial = bench.trial
    return _recorded(
        run, bench, stage, lambda: SharedStatistics.of(run.model, trial.gated, plan, run.calib, trial.batches)
    )


def _recorded(run: Run, bench: Bench, stage: Stage, recording: Callable[[], SharedStatistics]) -> SharedStatistics:
    """A sharing's statistics recorded on the unpruned model, their passes counted for `stage` where a layer
    shares: one over the calibration for the keys, then one over each set."""
    bench.trial.gated.use({})
    recorded = recording()
    if recorded.merges:
        bench.tally.add(stage, 2 * run.pricer.forward(run.calib) + bench.tally.heldout_pass)
    return recorded
