"""The depths along one nested order of units (the search's, else the plain ranking's): the deepest within a
quality bound (`selection.max_loss`) and the frontier of asked depths (`selection.depths`), each a prefix of that
order with every pruned layer refitted, measured on the held-out batches (and a second text) against the
unpruned model, and where the run shares KV heads (a KV-cache budget or a loss bound) also with KV heads shared
in place of the groups it empties."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from ..config import PruneConfig
from ..errors import ConfigError
from ..evaluation.confidence import perplexity_change
from ..model.kv_sharing import Merges
from ..model.layers import parameters_after
from ..recovery.candidates import Candidate, Decision, Trial, choose
from ..recovery.holdout import SequenceNLL, sequence_nll
from ..recovery.prefixes import Depth, deepest_within, prefix_length, prefix_plan
from ..recovery.search import Searched, Unit
from ..recovery.sharing_statistics import SharedStatistics
from ..runtime.devices import input_device
from ..runtime.ledger import Stage
from ..runtime.progress import progress_bar
from ..scoring.kv_cache import fits_cache, kv_cache_size
from ..task_data import DataError, TaskData
from .records import Bench, Run, heldout_nll, refitted, worst_rise
from .sharing_candidates import put_shared, recorded_sharing, run_cannot_share, shared_where_better

MAX_LOSS_RULE = (
    "the longest prefix of the searched order (the plain ranking's where no search ran) whose held-out perplexity "
    "rise (point estimate; a classifier's on its labels, the exp of the mean cross-entropy), each pruned layer "
    "refitted, is at most the bound, on the calibration's held-out text and on the general-ability guard's where "
    "it is on; where KV heads are shared, each prefix's rise is the lower of removing its groups and keeping their "
    "query heads on a kept KV head in the layers whose refit fits better so; another candidate plan or tuning is "
    "kept only where the rises stay within it"
)
FRONTIER_RULE = (
    "each depth is the prefix of one nested order (the search's, else the plain ranking's; to the deepest asked) "
    "with each pruned layer refitted, before tuning; the change is the perplexity's against the unpruned model's "
    "on the same sequences, with a 95% paired bootstrap interval over them; where KV heads are shared (a KV-cache "
    "budget or a loss bound), each depth also with the emptied groups' query heads kept on a kept KV head in the "
    "layers whose refit fits better so, at the same cache"
)
FRONTIER_CACHE_TYPES = ("f16", "q8_0")  # llama.cpp's default KV cache and its 8-bit one
Measured = tuple[float, tuple[float, float], float | None, tuple[float, float] | None]


def within_loss(
    run: Run, bench: Bench, searched: Searched, earlier: SharedStatistics | None
) -> tuple[Searched, dict[str, Any], SharedStatistics | None]:
    """The longest prefix of the searched order whose held-out perplexity rise, each pruned layer refitted
    (before tuning), is within `selection.max_loss`, as the searched plan, what the held-out summary says
    of it (`max_loss`: the bound, the heads of that prefix, the rises measured, the rule) and the sharing
    statistics recorded last (`earlier` where none were: a frontier's, for the candidates to reuse)."""
    percent = run.config.selection.max_loss
    if searched.plan is None or bench.unpruned is None or percent is None:
        raise ConfigError(f"selection.max_loss measures along the searched order, and there is none: {searched.note}")
    bound, shares = percent / 100, run_cannot_share(run, bench.trial) is None
    shared: dict[int, dict[str, Merges]] = {}  # the prefixes whose rise was measured shared
    last = earlier  # the statistics recorded last, for the next prefix or the candidates to reuse

    def rise_at(count: int) -> float:
        nonlocal last
        plan = prefix_plan(searched.order, count)
        refitted(run, bench, plan, Stage.DEPTH)
        removed = worst_rise(run, bench, bench.trial.gated, Stage.DEPTH)
        if not shares:
            return removed
        last = recorded_sharing(run, bench, plan, Stage.DEPTH, last)
        sharing = shared_where_better(bench, plan, last, Stage.DEPTH)
        if not sharing:
            return removed
        put_shared(bench, plan, sharing, last, Stage.DEPTH)
        kept = worst_rise(run, bench, bench.trial.gated, Stage.DEPTH)
        if kept < removed:
            shared[count] = sharing
        return min(kept, removed)

    count, rises = deepest_within(len(searched.order), rise_at, bound)
    bench.trial.gated.use({})
    plan = prefix_plan(searched.order, count)
    heads = sum(len(h) for h in plan.values())
    measured = [[sum(len(u) for _, u in searched.order[:k]), rises[k]] for k in sorted(rises)]
    summary = {"bound": bound, "heads": heads, "rises": measured, "rule": MAX_LOSS_RULE}
    if count in shared:
        summary["shared_kv_heads"] = shared[count]
    return dataclasses.replace(searched, plan=plan, order=searched.order[:count]), summary, last


def within_bound(run: Run, bench: Bench) -> bool:
    """Whether the gated model's held-out perplexity rises are within `selection.max_loss` (always without one)."""
    percent = run.config.selection.max_loss
    return percent is None or worst_rise(run, bench, bench.trial.gated, Stage.DEPTH) <= percent / 100


def searched_prefix(trial: Trial, decision: Decision, measured: Candidate) -> Decision:
    """The order's prefix with its reconstruction (`measured`), the state whose rise chose the depth, in place of
    the candidate `decision` kept (the others' held-out values stay in the report)."""
    kept = choose(trial, [measured], measured.label)
    return dataclasses.replace(kept, tried=decision.tried)


def frontier_text(config: PruneConfig, eval_data: TaskData | Iterable[dict] | None) -> list[dict]:
    """The batches of a frontier's second text (none without depths)."""
    if config.selection.depths is None:
        return []
    second = list(eval_data or [])
    if not all("labels" in b for b in second):
        raise DataError("the frontier's second text (eval_data) needs labels: load it as a causal-lm task")
    return second


def frontier(run: Run, bench: Bench, searched: Searched) -> tuple[list[Depth], SharedStatistics | None]:
    """The unpruned model (depth 0), then each asked depth measured along the searched order: its prefix, each
    pruned layer refitted, against the unpruned model on the held-out batches (and the second text), with its
    KV cache and parameters, and measured shared where the run shares KV heads (`Depth.shared`); and the
    sharing statistics recorded last (None where none were), for a loss bound or the candidates to reuse."""
    if searched.plan is None or bench.unpruned is None:
        raise ConfigError(f"selection.depths measures along the searched order, and there is none: {searched.note}")
    gated = bench.trial.gated
    gated.use({})
    second = _second_nll(run, bench, gated)
    kv, parameters = _size(run, {})
    same, interval = (0.0, (0.0, 0.0)) if second is not None else (None, None)  # the unpruned model against itself
    found = [Depth(0.0, 0, 0, 0.0, (0.0, 0.0), same, interval, kv, parameters, {})]
    statistics = None
    with progress_bar(None, "frontier", len(run.budget.depths), run.progress) as bar:
        for share, heads in run.budget.depths:
            count = prefix_length(searched.order, heads)
            assert count is not None  # units of one size, checked before any data
            depth, statistics = _depth(run, bench, share, searched.order[:count], second, statistics)
            found.append(depth)
            bar.update()
    gated.use({})
    return found, statistics


def _depth(
    run: Run,
    bench: Bench,
    share: float,
    prefix: list[Unit],
    second: SequenceNLL | None,
    earlier: SharedStatistics | None,
) -> tuple[Depth, SharedStatistics | None]:
    """One depth: the `prefix`'s plan refitted on the gated model, measured on the held-out batches and the second
    text, and measured shared where the run shares KV heads; with the sharing statistics recorded for it (`earlier`
    where the run does not share)."""
    plan = prefix_plan(prefix, len(prefix))
    refitted(run, bench, plan, Stage.FRONTIER)
    heads, (kv, parameters) = sum(map(len, plan.values())), _size(run, plan)
    depth = Depth(share, len(prefix), heads, *_measured(run, bench, second), kv, parameters, plan)
    if run_cannot_share(run, bench.trial) is not None:
        return depth, earlier
    statistics = recorded_sharing(run, bench, plan, Stage.FRONTIER, earlier)
    return dataclasses.replace(depth, shared=_shared(run, bench, depth, second, statistics)), statistics


def _shared(
    run: Run, bench: Bench, depth: Depth, second: SequenceNLL | None, statistics: SharedStatistics
) -> Depth | None:
    """`depth` with the query heads of the KV groups it empties kept on KV heads it keeps, in the layers whose
    refit fits better so (the default path's 'mixed' candidate; `statistics`: those recorded for its plan),
    measured as the depth is, at the same KV cache; None where no layer fits better shared."""
    sharing = shared_where_better(bench, depth.plan, statistics, Stage.FRONTIER)
    if not sharing:
        return None
    plan = put_shared(bench, depth.plan, sharing, statistics, Stage.FRONTIER)
    measured, parameters = _measured(run, bench, second), parameters_after(run.model, plan, sharing)
    heads = sum(map(len, plan.values()))
    return Depth(depth.share, depth.units, heads, *measured, depth.kv_cache, parameters, plan, sharing)


def _measured(run: Run, bench: Bench, second: SequenceNLL | None) -> Measured:
    """The gated model's held-out perplexity change against the unpruned model's with its interval, and the
    same on the second text (None without one)."""
    seed, gated = run.config.scoring.seed, bench.trial.gated
    heldout = heldout_nll(run, bench.tally, gated, Stage.FRONTIER)
    assert bench.unpruned is not None and heldout is not None  # measured where the search ran
    change, interval = perplexity_change(bench.unpruned, heldout, seed)
    if second is None:
        return change, interval, None, None
    pruned = _second_nll(run, bench, gated)
    assert pruned is not None  # the same batches as the unpruned model's
    return (change, interval, *perplexity_change(second, pruned, seed))


def _size(run: Run, plan: dict[str, list[int]]) -> tuple[dict[str, int], int]:
    """The KV cache at the frontier's context per cache type the head size fits, and the parameters, once
    `plan` is removed."""
    context = run.config.selection.context
    caches = [c for c in FRONTIER_CACHE_TYPES if fits_cache(run.layers, c)]
    return {c: kv_cache_size(run.model, context, c, plan) for c in caches}, parameters_after(run.model, plan)


def _second_nll(run: Run, bench: Bench, forward: Any) -> SequenceNLL | None:
    """The NLL per sequence of the frontier's second text under `forward` (None without one), its pass counted
    as frontier work."""
    if not run.second:
        return None
    bench.tally.add(Stage.FRONTIER, run.pricer.forward(run.second))
    return sequence_nll(forward, run.second, input_device(run.model))


def at_budget(run: Run, searched: Searched) -> Searched:
    """The searched order's prefix that removes the budget's heads, the searched plan where the search went
    deeper for a frontier."""
    if searched.plan is None:
        return searched
    count = prefix_length(searched.order, run.budget.removes)
    assert count is not None  # units of one size, checked before any data
    return dataclasses.replace(searched, plan=prefix_plan(searched.order, count), order=searched.order[:count])
