"""Which schedule the search runs (`prune_heads.recovery.search`), chosen on its own measurements: the default
flow on SmolLM2-135M or Gemma 3 270M with the frontier's calibration (`frontier.py`), its search run with the
full schedule (`search_screen: false`: every unit measured on every search example in both rounds) and each
measurement's per-example divergences kept; then the shipped `search_order` replayed on them with other
schedules: each round screening on the first batch every unit (or, after the first round, those the earlier
screen does not rule out) and racing at most the cheapest `MARGIN` times its share over the rest, a batch at a
time or in one part, until each is clearly in or out (`Z`), or the whole search on fewer examples. A replay
that reaches a state the full schedule never measured measures it then. Per schedule: the work of its
measurements against the full schedule's (each priced as the search prices it: a pass over its examples from the
unit's block on), whether it ends in the full schedule's plan, and the held-out divergence of its plan after
the plan's refits (what the held-out choice between candidates sees) beside the full schedule's; then the
shipped default run live, its counted work (refits, kept block inputs and the proof included) beside the full
schedule's (`--live`).

The full search's measurements are kept in benchmarks/.search, so a second run replays them without running the
search again (the rest of the flow up to the search runs each time: its held-out batches judge the plans).

Run: .venv/bin/python benchmarks/search_schedules.py --model smollm2 --depth 1/3 [--live]
     (the full search about half an hour on 2 CPU cores; --model gemma3; --depth 1/2)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from dataclasses import replace
from pathlib import Path

import frontier
import torch
from common import markdown_table
from llm import windows

import prune_heads as ph
import prune_heads.pruner.flow as pruner
from prune_heads.recovery import search
from prune_heads.recovery.candidates import Candidate
from prune_heads.task_data import batch_size

OUT = Path(__file__).resolve().parent / ".search"
SCHEDULES = {  # name -> (batches measured, batches screened or None, whether the rest is raced a screen's worth at
    # a time (else as one part), margin, Z: the race's line, whether a later round screens only what the earlier
    # screen does not rule out)
    "full (search_screen: false)": (None, None, False, None, None, False),
    "screen 1 batch, raced a batch at a time, margin 2, ruled out (default)": (None, 1, True, 2.0, search.Z, True),
    "screen 1 batch, the rest raced as one part, margin 2, ruled out": (None, 1, False, 2.0, search.Z, True),
    "screen 1 batch, raced a batch at a time, margin 2, every unit screened": (None, 1, True, 2.0, search.Z, False),
    "screen 1 batch, margin 2, every unit of the margin, every unit screened": (None, 1, False, 2.0, math.inf, False),
    "screen 1 batch, raced a batch at a time, margin 1.25, ruled out": (None, 1, True, 1.25, search.Z, True),
    "screen 1 batch, raced a batch at a time, margin 4, ruled out": (None, 1, True, 4.0, search.Z, True),
    "screen 1 batch, raced a batch at a time at 1 standard error, ruled out": (None, 1, True, 2.0, 1.0, True),
    "first 2 batches only": (2, None, False, None, None, False),
    "first 2 batches, screen 1, raced a batch at a time, margin 2, ruled out": (2, 1, True, 2.0, search.Z, True),
}


class _Stop(Exception):
    pass


def key(plan: dict) -> tuple:
    """A plan as a hashable, sorted key."""
    return tuple(sorted((name, tuple(heads)) for name, heads in plan.items() if heads))


class Log:
    """Every measurement's per-example divergences over the search's examples, by plan; a plan not yet in it is
    measured by the search (`bind`) on all of them. `spent` sums the work of what a replay read, per unit of
    one pass over all the search's examples from block 0."""

    def __init__(self, path: Path) -> None:
        self.path = path
        saved = json.loads(path.read_text()) if path.exists() else {"log": []}
        self.values = {tuple((n, tuple(h)) for n, h in k): torch.tensor(v) for k, v in saved["log"]}
        self.search, self.spent, self.read = None, 0.0, {}

    def bind(self, measured) -> None:
        """Measure missing plans with `measured`, the search's own `cost` (its object prices the passes)."""
        self.search = measured

    def save(self) -> None:
        found = [[list(map(list, k)), v.tolist()] for k, v in self.values.items()]
        self.path.write_text(json.dumps({"log": found}))

    def examples(self, plan: dict, changed: str) -> torch.Tensor:
        k = key(plan)
        if k not in self.values:
            self.values[k] = self.search(plan, changed, 0).double().cpu()
        return self.values[k]

    def cost(self, sizes: list[int], measured: int | None, screened: int | None, raced: bool):
        """The cost a replay reads: over the first `measured` batches (all: None), and where `screened` batches
        are screened first, the rest in parts of as many batches (`raced`) or in one."""
        total = sum(sizes)
        used = sizes[: measured or len(sizes)]
        step = screened if raced else len(used)
        ends = [screened, *range(screened + step, len(used), step), len(used)] if screened else [len(used)]
        cuts = [0, *(sum(used[:end]) for end in ends)]
        owner = self.search.__self__

        def cost(plan: dict, changed: str, part: int) -> torch.Tensor:
            a, b = cuts[part], cuts[part + 1]
            read = self.read.setdefault(key(plan), 0)
            if b > read:  # what this replay has not read of this plan yet
                share = (b - max(a, read)) / total
                self.spent += share * owner.price(changed, 0) / owner.parts[0].work
                self.read[key(plan)] = b
            return self.examples(plan, changed)[a:b]

        return cost, len(cuts) - 1


def replay(log: Log, context: dict, sizes: list[int], measured, screened, raced, margin, z, ruled_out) -> list:
    """The order the shipped `search_order` gives with this schedule, on the log."""
    log.spent, log.read = 0.0, {}
    saved = search.MARGIN, search.Z, search._screen
    search.MARGIN, search.Z = margin or saved[0], z or saved[1]
    if not ruled_out:  # every unit screened in every round: no earlier screens to rule one out by
        search._screen = lambda eligible, cost, confirmed, earlier, bar: saved[2](eligible, cost, confirmed, {}, bar)
    try:
        cost, parts = log.cost(sizes, measured, screened, raced)
        order, _ = search.search_order(context["units"], context["budget"], context["rounds"], cost, parts)
    finally:
        search.MARGIN, search.Z, search._screen = saved
    return order


def run(args) -> None:
    OUT.mkdir(exist_ok=True)
    name = f"{args.model}_{args.depth.replace('/', '-')}"
    log, context = Log(OUT / f"{name}.json"), {}
    shipped_order, shipped_plan = search.search_order, pruner.searched_plan

    def logged_order(units, budget, rounds, cost, parts=1, progress=False):
        log.bind(cost)
        context.update(units=units, budget=budget, rounds=rounds)
        return shipped_order(units, budget, rounds, lambda p, c, part: log.examples(p, c), 1, progress)

    def compared(trial, scores, budget, calib, schedule, pricer, limit):
        search.search_order = logged_order
        try:
            full = shipped_plan(trial, scores, budget, calib, replace(schedule, screen=False), pricer, limit)
        finally:
            search.search_order = shipped_order
        log.save()
        sizes = [batch_size(b) for b in search._first_examples(calib, schedule.examples)]
        heldout = {}

        def judged(plan: dict) -> float:
            if key(plan) not in heldout:
                state = trial.state(Candidate("search", plan, "reconstruction"))
                heldout[key(plan)] = float(trial.measure(state).mean())
            return heldout[key(plan)]

        rows = []
        for label, settings in SCHEDULES.items():
            order = replay(log, context, sizes, *settings)
            spent = log.spent
            trial.gated.restore()
            plan = ph.select_heads(search.searched_scores(scores, order), budget)
            same = "yes" if key(plan) == key(full.plan) else f"no ({len(set(key(plan)) ^ set(key(full.plan)))} layers)"
            rows.append([label, f"{spent:.1f}", same, f"{judged(plan):.4f}"])
            print(label, rows[-1], flush=True)
        log.save()
        rows = [[r[0], f"{float(r[1]) / float(rows[0][1]):.0%} ({r[1]})", *r[2:]] for r in rows]
        headers = ["schedule", "measurements' work (passes over the search's examples)", "full plan", "held-out"]
        print(f"\n{args.model} at {args.depth} of the KV groups, search examples in batches of {sizes}:\n")
        print(markdown_table(headers, rows))
        one = pricer.forward_backward(calib)
        replayed = "replayed: without the refits and kept block inputs a live run adds"
        print(f"\nCounted work of the search, in fisher passes: the full schedule {full.work / one:.2f} ({replayed})")
        if args.live:
            trial.gated.restore()
            shipped = shipped_plan(trial, scores, budget, calib, schedule, pricer, limit)
            same = "the same plan as" if key(shipped.plan) == key(full.plan) else "another plan than"
            print(f"the shipped default run live {shipped.work / one:.2f}, {same} the full schedule")
        raise _Stop

    pruner.searched_plan = compared
    base, tokenizer = frontier.MODELS[args.model]()
    calibration = windows(tokenizer, "movie-snippets", "train[:1000]")
    layers = ph.find_attention(base)
    heads = sum(l.num_heads for l in layers)
    groups = {"min_heads_per_layer": 0} if all(l.num_kv_heads == 1 for l in layers) else {}
    with contextlib.suppress(_Stop):  # raised once the schedules are compared: the rest of the flow is not needed
        frontier.default(base, calibration, round(heads * frontier.DEPTHS[args.depth]), **groups)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=list(frontier.MODELS), default="smollm2")
    parser.add_argument("--depth", choices=list(frontier.DEPTHS), default="1/3")
    parser.add_argument("--live", action="store_true", help="also run the shipped default's search, counting it")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
