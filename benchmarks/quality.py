"""Retraining-free pruning quality on the sentiment classifiers: the default path (`ph.prune_model()` with
held-out decisions) beside fisher one-shot and the fixed full recovery, all through `prune_model`.

Calibrate and score on validation, report accuracy on test after removing 25 to 90% of the 72 heads, the
seconds `prune_model` took (scoring, selection, recovery; evaluation excluded), and what the held-out
decisions kept. Each cell also gives the change against the unpruned model with its 95% paired bootstrap
interval over the test examples (`prune_heads.evaluation.confidence`), so a goal on it is met, not met, or within noise.

With `--seeds N`, every cell is run with scoring seeds 0..N-1 (the seed draws Fisher's sampled labels and
the tuning's batch order): the accuracy is the mean over seeds ± its standard error over seeds, and the interval
is that of the seed-averaged per-example correctness against the unpruned model's (test-set noise).
`--versus NAME` adds, per cell, the default's change against that row on the same examples.

`--max-loss PCT` (repeatable) instead prunes each fixture with the default path under that quality bound
(`SelectionConfig(max_loss=PCT)`: as many heads as keep the held-out label perplexity, the exp of the mean
cross-entropy on the held-out fifth of validation, within PCT%) and gives the heads it removed, the rises it
measured and the test accuracy's change with its interval.

Run: .venv/bin/python benchmarks/quality.py [--fixture movie|tweet|product|news] [--only TEXT] [--sparsity 0.5 ...]
[--seeds N] [--versus "fisher one-shot"] [--max-loss 3] (about 20 minutes on 2 CPU cores for the two shared
fixtures and one seed, and about 8 for `--max-loss 3` alone; `product` and `news` are classifiers no default was
tuned on, which benchmarks/extra_classifiers.py builds)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys

import numpy as np
from common import (
    FIXTURES_BY_NAME,
    Timer,
    classifier,
    correctness,
    decisions,
    markdown_table,
    seconds_range,
    sparsity_header,
    torch_threads,
    verdict,
)

import prune_heads as ph
from prune_heads.evaluation.confidence import compare, mean_of

SPARSITIES = (0.25, 0.5, 0.75, 0.9)
GOALS = {0.5: 0.25, 0.75: 2.0}  # sparsity: accuracy points the default may lose (issue 11)
FISHER = ph.ScoringConfig(method="fisher")
CONFIGS = {
    "random": ph.PruneConfig(scoring=ph.ScoringConfig(method="random"), recovery=ph.RecoveryConfig.off()),
    "gradient one-shot (Michel)": ph.PruneConfig(
        scoring=ph.ScoringConfig(method="gradient"), recovery=ph.RecoveryConfig.off()
    ),
    "fisher one-shot": ph.PruneConfig(scoring=FISHER, recovery=ph.RecoveryConfig.off()),
    "full recovery, fixed (fisher + rearrangement + gate and bias tuning, 4 epochs, no hold-out)": ph.PruneConfig(
        scoring=FISHER, recovery=ph.RecoveryConfig(holdout=0, bias_compensation=False, projection_tuning=False)
    ),
    "**default** (held-out decisions)": ph.PruneConfig(),
    # then healed by distillation from the unpruned model on the calibration rows and their labels (`--heal 1M`)
    "default, healed 1M": ph.PruneConfig(recovery=ph.RecoveryConfig(heal=1_000_000)),
}


def summary(accuracies: list[float]) -> str:
    """One accuracy, or the mean and standard error of several (one per seed)."""
    if len(accuracies) == 1:
        return f"{accuracies[0]:.3f}"
    error = statistics.stdev(accuracies) / math.sqrt(len(accuracies))
    return f"{statistics.mean(accuracies):.3f} ± {error:.3f}"


def change(before: np.ndarray, after: np.ndarray) -> dict:
    """after - before in accuracy points (per-example correctness, averaged over seeds), paired 95% interval."""
    found = compare(mean_of(before), mean_of(after))
    return {k: 100 * v if k in ("delta", "low", "high") else v for k, v in found.items()}


def loss_bound(fixtures: list[str], percents: list[float]) -> None:
    """The default path under each quality bound on each fixture: heads removed, the refitted rises measured
    (before tuning), the held-out rise at the end and the test accuracy's change against the unpruned model."""
    rows = []
    for fixture in fixtures:
        model, validation, test = classifier(fixture)
        unpruned = correctness(model, test)
        for percent in percents:
            model = classifier(fixture)[0]
            config = ph.PruneConfig(selection=ph.SelectionConfig(max_loss=percent))
            with Timer() as t:
                result = ph.prune_model(model, validation, config, progress=False)
            bound = result.heldout["max_loss"]
            rises = ", ".join(f"{100 * rise:+.1f}% at {heads}" for heads, rise in bound["rises"])
            points = change(unpruned, correctness(model, test))
            accuracy = f"{points['delta']:+.2f} ({points['low']:+.2f} to {points['high']:+.2f})"
            final = f"{100 * result.heldout['perplexity_change']:+.1f}%"
            rows.append(
                [fixture, f"{percent:g}%", f"{bound['heads']} of 72", rises, final, accuracy, f"{t.seconds:.0f}"]
            )
            print(*rows[-1], file=sys.stderr, flush=True)
    headers = ["fixture", "bound", "heads removed", "rises measured (refitted, before tuning)", "held-out rise"]
    headers += ["test accuracy, points (95% paired interval)", "seconds"]
    print(f"\nThe default path under a quality bound, scored on validation; {torch_threads()} CPU threads\n")
    print(markdown_table(headers, rows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fixture", choices=sorted(FIXTURES_BY_NAME), action="append")
    parser.add_argument(
        "--only", action="append", help="run only the configurations whose name contains this text (repeatable)"
    )
    parser.add_argument("--sparsity", type=float, action="append")
    parser.add_argument("--seeds", type=int, default=1, help="scoring seeds 0..N-1 per cell (mean ± standard error)")
    parser.add_argument(
        "--versus",
        default=None,
        help="also the default's change against the row whose name contains this text, per cell",
    )
    parser.add_argument("--max-loss", type=float, action="append", help="prune under this quality bound instead")
    args = parser.parse_args()
    if args.max_loss:
        return loss_bound(args.fixture or ["movie", "tweet"], args.max_loss)
    sparsities = tuple(args.sparsity or SPARSITIES)
    for fixture in args.fixture or ["movie", "tweet"]:
        _, validation, test = classifier(fixture)
        unpruned = correctness(classifier(fixture)[0], test)
        base = float(unpruned.mean())
        rows, per_cell = [], {}
        for name, config in CONFIGS.items():
            if args.only and not any(text in name for text in args.only):
                continue
            cells, seconds = [], []
            for sparsity in sparsities:
                accuracies, kept, correct = [], [], []
                for seed in range(args.seeds):
                    model = classifier(fixture)[0]
                    config_at = ph.PruneConfig(
                        selection=ph.SelectionConfig(sparsity=sparsity),
                        scoring=dataclasses.replace(config.scoring, seed=seed),
                        recovery=config.recovery,
                    )
                    with Timer() as t:
                        result = ph.prune_model(model, validation, config_at, progress=False)
                    correct.append(correctness(model, test))
                    accuracies.append(float(correct[-1].mean()))
                    seconds.append(t.seconds)
                    kept.append(decisions(result))
                    print(
                        name,
                        sparsity,
                        seed,
                        f"{accuracies[-1]:.3f}",
                        kept[-1],
                        f"{t.seconds:.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                per_cell[name, sparsity] = np.mean(correct, axis=0)
                points = change(unpruned, per_cell[name, sparsity])
                shown = "default" in name and args.seeds == 1
                cells.append(
                    summary(accuracies) + f" ({points['delta']:+.1f}, {points['low']:+.1f} to "
                    f"{points['high']:+.1f})" + (f" ({kept[0]})" if shown else "")
                )
            rows.append([name, *cells, seconds_range(seconds)])
        versus = next((n for n in CONFIGS if args.versus and args.versus in n), None)
        default = next(n for n in CONFIGS if "default" in n)
        if versus and (versus, sparsities[0]) in per_cell and (default, sparsities[0]) in per_cell:
            cells = []
            for sparsity in sparsities:
                points = change(per_cell[versus, sparsity], per_cell[default, sparsity])
                cells.append(
                    f"{points['delta']:+.1f} ({points['low']:+.1f} to {points['high']:+.1f}): "
                    f"{'within noise' if points['noise'] else 'real'}"
                )
            rows.append([f"default - {versus.split(' (')[0]}, same examples", *cells, ""])
        for sparsity, allowed in GOALS.items():
            if (default, sparsity) in per_cell:
                points = change(unpruned, per_cell[default, sparsity])
                print(
                    f"goal at {sparsity:.0%} (at most {allowed} points lost): {points['delta']:+.2f} points, "
                    f"95% CI {points['low']:+.2f} to {points['high']:+.2f}: {verdict(points, allowed)}",
                    file=sys.stderr,
                    flush=True,
                )
        error = math.sqrt(base * (1 - base) / test.num_examples)
        print(
            f"\n{fixture}: {FIXTURES_BY_NAME[fixture][0]} (72 heads), unpruned test accuracy {base:.3f} (standard "
            f"error of one accuracy on {test.num_examples} test examples: {error:.3f}); scored on validation "
            f"({validation.num_examples}); no retraining; {torch_threads()} CPU threads"
            + (f"; each cell: mean ± standard error over scoring seeds 0-{args.seeds - 1}" if args.seeds > 1 else "")
            + "; in brackets the change against the unpruned model in points and its 95% paired interval.\n"
        )
        print(markdown_table(sparsity_header(sparsities), rows))


if __name__ == "__main__":
    main()
