"""Issue 3 benchmark: test accuracy of the fixture after removing 25/50/75% of its 72 heads, per scoring
method, one-shot and iterative; scoring time; and the gradient scorer's time over the floor (one forward +
backward pass with frozen parameters over the same batches).

Run: .venv/bin/python benchmarks/scoring.py   (about 15 minutes on 2 CPU cores)
"""

from __future__ import annotations

import statistics
import sys

import torch
from common import Timer, accuracy, fixture, load_model, markdown_table, torch_threads

import prune_heads as ph

SPARSITIES = (0.25, 0.5, 0.75)
ONE_SHOT = ("gradient", "fisher", "taylor", "activation", "magnitude", "ablation")
ITERATIVE = ("gradient", "fisher")


def floor_pass(model, batches) -> None:
    """Forward + backward with frozen parameters: gradients reach the input embeddings, no weights."""
    model.requires_grad_(False)
    embeddings = model.get_input_embeddings()
    for batch in batches:
        inputs = {k: v for k, v in batch.items() if k != "input_ids"}
        embedded = embeddings(batch["input_ids"]).detach().requires_grad_()
        loss = model(inputs_embeds=embedded, **inputs).loss
        torch.autograd.grad(loss, embedded)


def floor_ratio(validation, rounds: int = 3) -> tuple[float, float, float]:
    """Median seconds of the gradient scorer and of the floor, timed in turns, and their ratio."""
    model = load_model()
    scorer, floor = [], []
    floor_pass(model, validation.batches[:2])  # warm-up
    for _ in range(rounds):
        with Timer() as t:
            ph.score_heads(model, validation, method="gradient", progress=False)
        scorer.append(t.seconds)
        with Timer() as t:
            floor_pass(model, validation)
        floor.append(t.seconds)
    a, b = statistics.median(scorer), statistics.median(floor)
    return a, b, a / b


def main() -> None:
    _, validation, test = fixture()
    base = accuracy(load_model(), test)
    rows = []
    for method in ("random",) + ONE_SHOT:
        seeds = (0, 1, 2) if method == "random" else (0,)
        accs, seconds = {s: [] for s in SPARSITIES}, []
        for seed in seeds:
            model = load_model()
            with Timer() as t:
                scores = ph.score_heads(model, validation, method=method, seed=seed, progress=False)
            seconds.append(t.seconds)
            for sparsity in SPARSITIES:
                pruned = load_model()
                ph.prune(pruned, ph.select_heads(scores, sparsity=sparsity))
                accs[sparsity].append(accuracy(pruned, test))
        label = f"{method} (mean of 3 seeds)" if method == "random" else method
        rows.append(
            [label, "one-shot", *[statistics.mean(accs[s]) for s in SPARSITIES], f"{statistics.mean(seconds):.1f} s"]
        )
        print(rows[-1], file=sys.stderr, flush=True)
    for method in ITERATIVE:
        accs, seconds = [], []
        for sparsity in SPARSITIES:
            model = load_model()
            with Timer() as t:
                ph.prune_iteratively(
                    model,
                    validation,
                    sparsity,
                    steps=max(2, round(sparsity / 0.125)),
                    method=method,
                    progress=False,
                )
            seconds.append(t.seconds)
            accs.append(accuracy(model, test))
        rows.append(
            [method, "iterative (12.5% of heads per step)", *accs, " / ".join(f"{s:.0f}" for s in seconds) + " s"]
        )
        print(rows[-1], file=sys.stderr, flush=True)
    scorer, floor, ratio = floor_ratio(validation)
    print(
        f"Fixture: {ph.__name__} on minilm-movie-sentiment, 72 heads; scored on validation (1,000), accuracy on "
        f"test (2,000); unpruned test accuracy {base:.3f}; {torch_threads()} CPU threads.\n"
    )
    print(markdown_table(["method", "how", "25% removed", "50% removed", "75% removed", "scoring time"], rows))
    print(
        f"\nGradient scoring of the 1,000 validation examples: {scorer:.2f} s; floor (forward + backward with "
        f"frozen parameters, same batches): {floor:.2f} s; ratio {ratio:.3f} (goal <= 1.10)."
    )


if __name__ == "__main__":
    main()
