"""Retraining-free pruning quality on both fixture classifiers: the default path (`ph.prune_model()` with
held-out decisions) beside fisher one-shot and the fixed full recovery, all through `prune_model`.

Calibrate and score on validation, report accuracy on test (with its standard error) after removing 25 to
90% of the 72 heads, the seconds `prune_model` took (scoring, selection, recovery; evaluation excluded), and
what the held-out decisions kept.

Run: .venv/bin/python benchmarks/quality.py [--fixture movie|tweet|product] [--only TEXT] [--sparsity 0.5 ...]
(about 20 minutes on 2 CPU cores for the two shared fixtures; `product` is the third classifier, which
benchmarks/third_classifier.py builds first)
"""

from __future__ import annotations

import argparse
import math
import sys

import prune_heads as ph
from common import (FIXTURES_BY_NAME, Timer, accuracy, classifier, markdown_table, seconds_range, sparsity_header,
                    torch_threads)

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


def decisions(result: ph.PruneResult) -> str:
    """What the held-out decisions kept, in a few words."""
    kept = [e for e in result.recovery if e["step"] == "selection"]
    tuning = [e for e in result.recovery if "tuning" in e["step"]]
    words = [kept[0]["kept"]] if kept and kept[0]["tried"]["ranked"] is not None else []
    if tuning and tuning[0].get("kept", True):
        words.append(f"tuned {tuning[0]['epochs_run']} ep")
    return ", ".join(words) or "-"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fixture", choices=sorted(FIXTURES_BY_NAME), action="append")
    parser.add_argument("--only", default="", help="run only the configurations whose name contains this text")
    parser.add_argument("--sparsity", type=float, action="append")
    args = parser.parse_args()
    sparsities = tuple(args.sparsity or SPARSITIES)
    for fixture in args.fixture or ["movie", "tweet"]:
        _, validation, test = classifier(fixture)
        base = accuracy(classifier(fixture)[0], test)
        rows = []
        for name, config in CONFIGS.items():
            if args.only not in name:
                continue
            cells, seconds = [], []
            for sparsity in sparsities:
                model = classifier(fixture)[0]
                config_at = ph.PruneConfig(selection=ph.SelectionConfig(sparsity=sparsity), scoring=config.scoring,
                                           recovery=config.recovery)
                with Timer() as t:
                    result = ph.prune_model(model, validation, config_at, progress=False)
                acc = accuracy(model, test)
                seconds.append(t.seconds)
                cells.append(f"{acc:.3f}" + (f" ({decisions(result)})" if "default" in name else ""))
                print(name, sparsity, cells[-1], f"{t.seconds:.1f} s", file=sys.stderr, flush=True)
            rows.append([name, *cells, seconds_range(seconds)])
        error = math.sqrt(base * (1 - base) / test.num_examples)
        print(f"\n{fixture}: {FIXTURES_BY_NAME[fixture][0]} (72 heads), unpruned test accuracy {base:.3f} (standard "
              f"error of one accuracy on {test.num_examples} test examples: {error:.3f}); scored on validation "
              f"({validation.num_examples}); no retraining; {torch_threads()} CPU threads.\n")
        print(markdown_table(sparsity_header(sparsities), rows))


if __name__ == "__main__":
    main()
