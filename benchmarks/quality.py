"""Issue 6 benchmark: retraining-free recovery on the fixture. Calibrate and score on validation (1,000),
report accuracy on test (2,000) after removing 25/50/75/90% of the 72 heads, and the CPU seconds each
method took (scoring + selection + surgery + recovery; evaluation not included).

Run: .venv/bin/python benchmarks/quality.py [--only TEXT]   (about 20 minutes on 2 CPU cores; --only runs the
methods whose name contains TEXT)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

import prune_heads as ph
from common import Timer, accuracy, fixture, load_model, markdown_table, torch_threads

SPARSITIES = (0.25, 0.5, 0.75, 0.9)


def random_plan(model, validation, sparsity, seed=0):
    ph.prune(model, ph.select_heads(ph.score_heads(model, validation, method="random", seed=seed, progress=False),
                                    sparsity=sparsity))


def gradient_one_shot(model, validation, sparsity):
    ph.prune(model, ph.select_heads(ph.score_heads(model, validation, progress=False), sparsity=sparsity))


def gradient_iterative(model, validation, sparsity):
    ph.prune_iteratively(model, validation, sparsity=sparsity, steps=max(2, round(sparsity / 0.125)),
                         progress=False)


def fisher_rearranged(model, validation, sparsity, tuning=False, bias=False):
    reference = copy.deepcopy(model) if tuning or bias else None
    scores = ph.score_heads(model, validation, method="fisher", progress=False)
    ph.prune(model, ph.plan_with_interactions(scores, sparsity=sparsity))
    if tuning or bias:
        ph.reconstruct(model, reference, validation.without_labels(), scales=tuning, bias=bias)


def fisher_rearranged_tuned(model, validation, sparsity, steps=1, epochs=2, bias_lr=None):
    """Fisher + rearrangement (in `steps` re-scored steps), then the kept heads' gates (and with `bias_lr`
    the output biases) tuned to the unpruned model's outputs (KL) and folded into the weights."""
    reference = copy.deepcopy(model)
    for step in range(1, steps + 1):
        scores = ph.score_heads(model, validation, method="fisher", progress=False)
        ph.prune(model, ph.plan_with_interactions(scores, sparsity=sparsity * step / steps))
    ph.tune_gates(model, reference, validation.without_labels(), epochs=epochs, bias_lr=bias_lr)


METHODS = {
    "random (mean of 3 seeds)": None,
    "gradient, one-shot (Michel)": gradient_one_shot,
    "gradient, iterative (Michel, 12.5% per step)": gradient_iterative,
    "fisher + rearrangement (Kwon)": fisher_rearranged,
    "fisher + rearrangement + mask tuning": lambda m, v, s: fisher_rearranged(m, v, s, tuning=True),
    "fisher + rearrangement + mask tuning + bias compensation":
        lambda m, v, s: fisher_rearranged(m, v, s, tuning=True, bias=True),
    "fisher + rearrangement + gate tuning (KL to the unpruned model)": fisher_rearranged_tuned,
    "fisher + rearrangement in 3 re-scored steps + gate tuning": lambda m, v, s: fisher_rearranged_tuned(m, v, s, 3),
    "fisher + rearrangement + gate tuning, 4 epochs": lambda m, v, s: fisher_rearranged_tuned(m, v, s, epochs=4),
    "fisher + rearrangement + gate and output-bias tuning, 4 epochs":
        lambda m, v, s: fisher_rearranged_tuned(m, v, s, epochs=4, bias_lr=0.01),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="run only the methods whose name contains this text")
    only = parser.parse_args().only
    _, validation, test = fixture()
    base = accuracy(load_model(), test)
    rows = []
    for name, method in METHODS.items():
        if only not in name:
            continue
        accs, seconds = [], []
        for sparsity in SPARSITIES:
            runs = []
            for seed in ((0, 1, 2) if method is None else (0,)):
                model = load_model()
                with Timer() as t:
                    if method is None:
                        random_plan(model, validation, sparsity, seed)
                    else:
                        method(model, validation, sparsity)
                runs.append(accuracy(model, test))
                seconds.append(t.seconds)
            accs.append(statistics.mean(runs))
        rows.append([name, *accs, "-" if method is None else f"{min(seconds):.0f}-{max(seconds):.0f} s"])
        print(rows[-1], file=sys.stderr, flush=True)
    print(f"Fixture minilm-movie-sentiment (72 heads), unpruned test accuracy {base:.3f}; calibration and scoring on "
          f"validation (1,000), accuracy on test (2,000); no retraining; {torch_threads()} CPU threads.\n")
    print(markdown_table(["method", *[f"{s:.0%} removed" for s in SPARSITIES], "time (per sparsity)"], rows))


if __name__ == "__main__":
    main()
