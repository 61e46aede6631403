"""Retraining-free pruning quality on both fixture classifiers: the default path (`ph.prune_model()` with
held-out decisions) beside fisher one-shot and the fixed full recovery, all through `prune_model`.

Calibrate and score on validation, report accuracy on test (with its standard error) after removing 25 to
90% of the 72 heads, the seconds `prune_model` took (scoring, selection, recovery; evaluation excluded), and
what the held-out decisions kept.

With `--seeds N`, every cell is run with scoring seeds 0..N-1 (the seed draws Fisher's sampled labels and
the tuning's batch order) and shows the mean accuracy and its standard error over the seeds: one seed's
cell moves by about a point, more than the 50% goal allows.

Run: .venv/bin/python benchmarks/quality.py [--fixture movie|tweet|product] [--only TEXT] [--sparsity 0.5 ...]
[--seeds N] (about 20 minutes on 2 CPU cores for the two shared fixtures and one seed; `product` is the third
classifier, which benchmarks/third_classifier.py builds first)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys

import prune_heads as ph
from common import (FIXTURES_BY_NAME, Timer, accuracy, classifier, decisions, markdown_table, seconds_range,
                    sparsity_header, torch_threads)

SPARSITIES = (0.25, 0.5, 0.75, 0.9)
FISHER = ph.ScoringConfig(method="fisher")
CONFIGS = {
    "random": ph.PruneConfig(scoring=ph.ScoringConfig(method="random"), recovery=ph.RecoveryConfig.off()),
    "gradient one-shot (Michel)": ph.PruneConfig(scoring=ph.ScoringConfig(method="gradient"),
                                                 recovery=ph.RecoveryConfig.off()),
    "fisher one-shot": ph.PruneConfig(scoring=FISHER, recovery=ph.RecoveryConfig.off()),
    "full recovery, fixed (fisher + rearrangement + gate and bias tuning, 4 epochs, no hold-out)":
        ph.PruneConfig(scoring=FISHER, recovery=ph.RecoveryConfig(holdout=0, bias_compensation=False)),
    "**default** (held-out decisions)": ph.PruneConfig(),
}


def summary(accuracies: list[float]) -> str:
    """One accuracy, or the mean and standard error of several (one per seed)."""
    if len(accuracies) == 1:
        return f"{accuracies[0]:.3f}"
    error = statistics.stdev(accuracies) / math.sqrt(len(accuracies))
    return f"{statistics.mean(accuracies):.3f} ± {error:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fixture", choices=sorted(FIXTURES_BY_NAME), action="append")
    parser.add_argument("--only", action="append", help="run only the configurations whose name contains this "
                        "text (repeatable)")
    parser.add_argument("--sparsity", type=float, action="append")
    parser.add_argument("--seeds", type=int, default=1, help="scoring seeds 0..N-1 per cell (mean ± standard error)")
    args = parser.parse_args()
    sparsities = tuple(args.sparsity or SPARSITIES)
    for fixture in args.fixture or ["movie", "tweet"]:
        _, validation, test = classifier(fixture)
        base = accuracy(classifier(fixture)[0], test)
        rows = []
        for name, config in CONFIGS.items():
            if args.only and not any(text in name for text in args.only):
                continue
            cells, seconds = [], []
            for sparsity in sparsities:
                accuracies, kept = [], []
                for seed in range(args.seeds):
                    model = classifier(fixture)[0]
                    config_at = ph.PruneConfig(selection=ph.SelectionConfig(sparsity=sparsity),
                                               scoring=dataclasses.replace(config.scoring, seed=seed),
                                               recovery=config.recovery)
                    with Timer() as t:
                        result = ph.prune_model(model, validation, config_at, progress=False)
                    accuracies.append(accuracy(model, test))
                    seconds.append(t.seconds)
                    kept.append(decisions(result))
                    print(name, sparsity, seed, f"{accuracies[-1]:.3f}", kept[-1], f"{t.seconds:.1f} s",
                          file=sys.stderr, flush=True)
                shown = "default" in name and args.seeds == 1
                cells.append(summary(accuracies) + (f" ({kept[0]})" if shown else ""))
            rows.append([name, *cells, seconds_range(seconds)])
        error = math.sqrt(base * (1 - base) / test.num_examples)
        print(f"\n{fixture}: {FIXTURES_BY_NAME[fixture][0]} (72 heads), unpruned test accuracy {base:.3f} (standard "
              f"error of one accuracy on {test.num_examples} test examples: {error:.3f}); scored on validation "
              f"({validation.num_examples}); no retraining; {torch_threads()} CPU threads"
              + (f"; each cell: mean ± standard error over scoring seeds 0-{args.seeds - 1}" if args.seeds > 1 else "")
              + ".\n")
        print(markdown_table(sparsity_header(sparsities), rows))


if __name__ == "__main__":
    main()
