"""Sharing KV heads against removing them, with the project's refits and measured on the whole model: SmolLM2-135M
(9 query heads over 3 KV heads in each of 30 layers), calibrated on movie text.

Each layer alone is cut to one KV head two ways: removal (two KV groups go with their 6 query heads) and sharing
(the two KV heads merged into the third, keys mapped, every query head kept), each with its output projection
refitted by the project's ridge chosen on held-out windows, the kept KV head the one whose refit has the lowest
held-out error. Each way's single-layer cut is measured on the whole model (held-out movie windows, mean token
NLL against the unpruned model's); then the cheapest layers by that measure make plans of 15, 23 and 30 layers
(30, 46 and 60 of the 90 KV heads gone) for removal alone, sharing alone and the better of the two per layer,
judged by perplexity on movie and tweet test text. No search, and no tuning unless asked: what the default path's search
would see per unit, and how the units add up when chosen greedily.

Run: .venv/bin/python benchmarks/sharing.py [--layers N] [--keys mapped|as-is]   (about 20 minutes on 2 cores)
     .venv/bin/python benchmarks/sharing.py --tune 30   (the plans of 30 KV heads gone, each tuned as the
     default path tunes: gates, output biases and rank-16 projection updates, 4 epochs, held-out stop)
     .venv/bin/python benchmarks/sharing.py --split   (eight query heads over two KV heads against removal,
     per layer, refit errors only)
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import torch
from common import markdown_table, torch_threads
from llm import smollm2, windows

from prune_heads.config import RecoveryConfig
from prune_heads.model.kv_sharing import shared_kv
from prune_heads.model.layers import find_attention
from prune_heads.recovery.gated import GatedModel
from prune_heads.recovery.holdout import sequence_nll
from prune_heads.recovery.reconstruction import Refit, refit
from prune_heads.recovery.sharing_statistics import merge_maps, reading, sharing_statistics
from prune_heads.recovery.tuning import Schedule, tune
from prune_heads.scoring.objective import Objective
from prune_heads.task_data import without_labels

DEPTHS = (15, 23, 30)  # layers cut to one KV head: 30, 46 and 60 of 90 KV heads gone


@dataclass
class Cut:
    """One layer cut to one KV head one way: the removed heads or the merges, the refit and its measured NLL."""

    removed: tuple[int, ...]
    merges: dict[int, int]
    refit: Refit
    nll: float = math.nan


def best_cut(layer, calibration, heldout, share: bool) -> Cut:
    """The layer cut to one KV head, the kept one the lowest held-out refit error's."""
    cuts = []
    for kept in layer.kv_heads:
        others = [g for g in layer.kv_heads if g != kept]
        if share:
            merges = dict.fromkeys(others, kept)
            fitted = refit(layer, (), calibration, heldout, reads=reading(layer, merges))
            cuts.append(Cut((), merges, fitted))
        else:
            removed = tuple(h for h in layer.heads if layer.kv_of(h) in others)
            cuts.append(Cut(removed, {}, refit(layer, removed, calibration, heldout)))
    return min(cuts, key=lambda c: c.refit.error)


def split_cuts(layer) -> list[tuple[tuple[int, ...], dict[int, int]]]:
    """Every cut of one KV head from the layer: its group removed whole, and eight over two (one of its query
    heads removed, the other two re-pointed one to each kept KV head), as (removed heads, reads)."""
    cuts = []
    for gone in layer.kv_heads:
        group = [h for h in layer.heads if layer.kv_of(h) == gone]
        kept = [g for g in layer.kv_heads if g != gone]
        cuts.append((tuple(group), {}))
        for removed in group:
            rest = [h for h in group if h != removed]
            cuts += [((removed,), dict(zip(rest, order))) for order in (kept, kept[::-1])]
    return cuts


def split_errors(layers, calibration, heldout, judged) -> list[tuple[str, float, float]]:
    """Per layer, removal's and eight over two's relative refit error on the judged tokens, each way's cut the
    one whose refit the held-out tokens rate best (the judged ones choose only the ridge)."""
    rows = []
    for layer in layers:
        cells = []
        for split in (False, True):
            fitted = [
                (refit(layer, r, calibration[layer.name], heldout[layer.name], reads=reads).error, r, reads)
                for r, reads in split_cuts(layer)
                if bool(reads) == split
            ]
            _, removed, reads = min(fitted, key=lambda f: f[0])
            cells.append(refit(layer, removed, calibration[layer.name], judged[layer.name], reads=reads).error)
        rows.append((layer.name, cells[0], cells[1]))
        print(*rows[-1], file=sys.stderr, flush=True)
    return rows


def mean_nll(gated: GatedModel, layers, cuts: dict[str, Cut], maps, batches) -> float:
    """The gated model's mean token NLL on `batches` with every cut in place (sharing run as hooks)."""
    return nlls(gated, layers, cuts, maps, {"": batches})[""]


def nlls(gated: GatedModel, layers, cuts: dict[str, Cut], maps, tests: dict, tuning=None) -> dict[str, float]:
    """The mean token NLL on each test's batches with every cut in place (sharing run as hooks); with `tuning`
    ((batches, unpruned outputs, held-out batches)), after the default path's tuning of the gates, output
    biases and projection updates to the unpruned outputs, its stop judged on the held-out batches."""
    plan = {name: list(c.removed) for name, c in cuts.items() if c.removed}
    gated.use(plan, refits={name: c.refit for name, c in cuts.items()})
    sharing = {name: c.merges for name, c in cuts.items() if c.merges}
    by_name = {l.name: l for l in layers}
    key_maps = {name: merge_maps(maps[name], by_name[name], m) for name, m in sharing.items()}
    with shared_kv(layers, sharing, key_maps):
        if tuning is not None:
            tuned(gated, *tuning)
        found = {name: sequence_nll(gated, batches, torch.device("cpu")) for name, batches in tests.items()}
    gated.use({})
    return {name: nll.mean for name, nll in found.items() if nll is not None}


def tuned(gated: GatedModel, batches: list[dict], targets: list, held: list[dict]) -> None:
    """Tune the gated state as the default path does (its rates, rank, epochs and held-out stop)."""
    r = RecoveryConfig()
    tunables = gated.tunables(r.gate_tuning, r.bias_tuning, r.projection_rank, 0)
    rates = {"gate": r.gate_lr, "bias": r.bias_lr, "projection": r.projection_lr}
    groups = [{"params": params, "lr": rates[name]} for name, params in tunables.items()]
    check = lambda: sequence_nll(gated, held, torch.device("cpu")).mean  # noqa: E731
    tune(gated, groups, batches, targets, Objective(gated.model), Schedule(r.epochs, 0, r.average), check)
    gated.freeze()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=30, help="measure the first N layers only (a quick look)")
    parser.add_argument("--keys", choices=("mapped", "as-is"), default="mapped", help="the re-pointed heads' keys")
    parser.add_argument("--split", action="store_true", help="eight over two against removal, per layer")
    parser.add_argument(
        "--tune", type=int, choices=[2 * d for d in DEPTHS], help="the plans of this many KV heads gone, tuned"
    )
    args = parser.parse_args()
    model, tokenizer = smollm2()
    calib = windows(tokenizer, "movie-snippets", "train[:1000]").batches
    fit, held, judge = calib[:4], calib[4:6], calib[6:8]  # 32 windows fitted, 16 choose ridges, 16 judge cuts
    tests = {
        "movie": windows(tokenizer, "movie-snippets", "test[:300]").batches,
        "tweets": windows(tokenizer, "tweet-snippets", "test[:300]").batches,
    }
    layers = find_attention(model)[: args.layers]
    mapped = args.keys == "mapped"
    calibration, heldout, maps = sharing_statistics(model, layers, fit, held, mapped=mapped)
    if args.split:
        print_split(layers, calibration, heldout, sharing_statistics(model, layers, fit, judge, mapped=mapped)[1])
        return
    print("statistics recorded", file=sys.stderr, flush=True)
    with GatedModel(model, find_attention(model)) as gated:
        unpruned = mean_nll(gated, layers, {}, maps, judge)
        ways: dict[str, dict[str, Cut]] = {"removal": {}, "sharing": {}}
        for layer in layers:
            for way, share in (("removal", False), ("sharing", True)):
                cut = best_cut(layer, calibration[layer.name], heldout[layer.name], share)
                cut.nll = mean_nll(gated, layers, {layer.name: cut}, maps, judge) - unpruned
                ways[way][layer.name] = cut
            print(layer.name, *(f"{w} {ways[w][layer.name].nll:+.4f}" for w in ways), file=sys.stderr, flush=True)
        ways["better of the two"] = {
            n: min((ways[w][n] for w in ("removal", "sharing")), key=lambda c: c.nll) for n in ways["removal"]
        }
        tuning = None
        if args.tune:
            unlabelled = [without_labels(b) for b in fit]
            objective = Objective(model)
            targets = [objective.reference(gated(b), b) for b in unlabelled]
            tuning = (unlabelled, targets, held)
        print_tables(gated, layers, ways, maps, tests, args.tune, tuning)


def print_split(layers, calibration, heldout, judged) -> None:
    """The per-layer comparison of eight over two with removal at one KV head gone, and how many layers each wins."""
    rows = split_errors(layers, calibration, heldout, judged)
    lower = sum(split < removal for _, removal, split in rows)
    print(
        f"SmolLM2-135M, one KV head of each of {len(rows)} layers cut alone ({torch_threads()} threads): eight over "
        f"two's relative refit error on 16 judged movie windows lower than removal's in {lower}."
    )
    cells = [[name, f"{r:.4f}", f"{e:.4f}", f"{100 * (e / r - 1):+.1f}%"] for name, r, e in rows]
    print(markdown_table(["layer", "removal (6 over 2)", "eight over two", "difference"], cells))


def print_tables(gated, layers, ways, maps, tests, depth=None, tuning=None) -> None:
    """The per-layer comparison, then each way's greedy plans judged on the test texts (with `depth` KV heads
    gone, tuned: `tuning`)."""
    removal, sharing = ways["removal"], ways["sharing"]
    lower_error = sum(sharing[n].refit.error < removal[n].refit.error for n in removal)
    lower_nll = sum(sharing[n].nll < removal[n].nll for n in removal)
    print(
        f"SmolLM2-135M, {len(removal)} layers each cut alone to one KV head ({torch_threads()} threads): sharing's "
        f"held-out refit error lower in {lower_error}, its whole-model held-out NLL rise lower in {lower_nll}."
    )
    base = {name: math.exp(mean_nll(gated, layers, {}, maps, batches)) for name, batches in tests.items()}
    rows = []
    for way, cuts in ways.items():
        order = sorted(cuts, key=lambda n: cuts[n].nll)
        for layers_cut in (d for d in DEPTHS if d <= len(order) and (depth is None or 2 * d == depth)):
            chosen = {n: cuts[n] for n in order[:layers_cut]}
            shared = sum(1 for c in chosen.values() if c.merges)
            found = nlls(gated, layers, chosen, maps, tests, tuning)
            cells = [f"{100 * (math.exp(found[t]) / base[t] - 1):+.1f}%" for t in tests]
            rows.append([way, f"{2 * layers_cut} ({layers_cut} layers, {shared} shared)", *cells])
            print(*rows[-1], file=sys.stderr, flush=True)
    print(f"perplexity unpruned: movie {base['movie']:.2f}, tweets {base['tweets']:.2f}\n")
    print(markdown_table(["way", "KV heads gone", "movie perplexity", "tweets perplexity"], rows))


if __name__ == "__main__":
    main()
