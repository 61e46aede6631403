"""Does the redundancy `analyze` reports predict what a cut costs? For each pair of heads it calls near-duplicates
(one explains at least three quarters of what the other writes), the pair's less important head is removed alone,
and so is the head of the nearest importance rank that is in no pair (the control); the same with the partner's
gate raised by the least-squares share it stands in for (the merge, what an output-projection refit can give).
Each removal's divergence from the unpruned model is measured on held-out text the analysis never saw, per
example, and the mean difference pair - control comes with its 95% paired bootstrap interval over examples.

Models: SmolLM2-135M (bfloat16; analysed on movie-snippets train[:1000], measured on test[:1000], windows of 256
tokens) and the movie fixture classifier (validation, measured on test).

Pairs compared: the near-duplicates first, then the most alike others by |cosine| (so a model with few or none,
such as the fixture, still shows whether being alike predicts a cheap cut), 12 in all unless `--pairs N`.

Run: .venv/bin/python benchmarks/analysis.py [--model smollm2|movie] [--pairs 12]   (SmolLM2: about 15 minutes)
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from common import Timer, classifier, markdown_table, torch_threads
from llm import smollm2, windows

import prune_heads as ph
from prune_heads.evaluation.analysis.derived import DUPLICATE
from prune_heads.evaluation.confidence import mean_of, paired_interval
from prune_heads.scoring.objective import Objective
from prune_heads.task_data import without_labels


def references(model, data) -> list:
    """The unpruned model's outputs on each batch, as the divergence takes them."""
    objective = Objective(model)
    with torch.no_grad():
        return [objective.reference(model(**without_labels(batch)), batch) for batch in data]


def divergences(model, data, kept: list, gates: dict[tuple[int, int], float]) -> np.ndarray:
    """Per example, the divergence from the unpruned model (`kept`, its references) with the given (layer, head
    position) gates set."""
    objective, found = Objective(model), []
    with torch.no_grad(), ph.head_gates(model, requires_grad=False) as gate:
        for (layer, position), value in gates.items():
            gate[layer][position] = value
        for batch, reference in zip(data, kept):
            found.append(objective.divergence(model(**without_labels(batch)), batch, reference).double())
    return torch.cat(found).numpy()


def alike(found: ph.Analysis, most: int) -> list[tuple[int, int, int]]:
    """(layer index, position, position) of the pairs of heads `analyze` calls near-duplicates, then of the most
    alike others (by |cosine| of what they write) up to `most` pairs in all."""
    called = {(p.layer, p.a, p.b) for p in found.duplicates if p.kind == "heads"}
    ranked = sorted(
        (
            (-abs(layer.similarity[i][j]), index, i, j)
            for index, layer in enumerate(found.layers)
            for i in range(len(layer.heads))
            for j in range(i + 1, len(layer.heads))
        )
    )
    first = [
        r
        for r in ranked
        if (found.layers[r[1]].name, found.layers[r[1]].heads[r[2]], found.layers[r[1]].heads[r[3]]) in called
    ]
    rest = [r for r in ranked if r not in first][: max(most - len(first), 0)]
    return [(index, i, j) for _, index, i, j in first + rest]  # fmt: skip


def comparisons(found: ph.Analysis, most: int) -> list[dict]:
    """For each pair: its less important head cut alone, cut with the partner's gate raised by the share it
    stands in for (the merge), and the control: the head nearest in rank among those in no pair compared."""
    pairs = alike(found, most)
    inside = {(index, h) for index, i, j in pairs for h in (i, j)}
    heads = [
        (layer.rank[i], index, i)
        for index, layer in enumerate(found.layers)
        for i in range(len(layer.heads))
        if (index, i) not in inside
    ]
    out = []
    for index, a, b in pairs:
        layer = found.layers[index]
        cut, keep = (a, b) if layer.rank[a] < layer.rank[b] else (b, a)
        share = layer.similarity[cut][keep] * layer.written[cut] / max(layer.written[keep], 1e-30)
        control = min(heads, key=lambda h: abs(h[0] - layer.rank[cut]))
        out.append(
            {
                "pair": f"{layer.name.split('.')[-2]}: {layer.heads[cut]} ~ {layer.heads[keep]}",
                "cosine": layer.similarity[cut][keep],
                "rank": f"{layer.rank[cut]} / {control[0]}",
                "cut": {(index, cut): 0.0},
                "merge": {(index, cut): 0.0, (index, keep): 1.0 + share},
                "control": {(control[1], control[2]): 0.0},
            }
        )
    return out


def summary(kind: str, values: list[np.ndarray]) -> str:
    mean = np.mean(values, axis=0)  # per example, averaged over the pairs
    low, high = paired_interval(mean_of(np.zeros_like(mean)), mean_of(mean))
    return f"{kind} - control, mean over {len(values)} pairs: {mean.mean():+.5f} (95% CI {low:+.5f} to {high:+.5f})"


def measure(name: str, model, calibration, heldout, most: int) -> None:
    with Timer() as timer:
        found = ph.analyze(model, calibration, progress=False)
    called = sum(p.kind == "heads" for p in found.duplicates)
    print(f"{name}: analysed in {timer.seconds:.0f} s ({found.passes:.2f} fisher passes), {called} pairs of heads "
          f"called near-duplicates; compared: those and the most alike others, {most} pairs in all")  # fmt: skip
    rows, kept = [], references(model, heldout)
    differences: dict[str, list] = {"called": [], "cut": [], "merge": []}
    for c in comparisons(found, most):
        cut, merge, control = (divergences(model, heldout, kept, c[k]) for k in ("cut", "merge", "control"))
        differences["cut"].append(cut - control)
        differences["merge"].append(merge - control)
        if c["cosine"] ** 2 >= DUPLICATE:
            differences["called"].append(cut - control)
        means = (f"{values.mean():.5f}" for values in (cut, merge, control))
        rows.append([c["pair"], f"{c['cosine']:+.3f}", c["rank"], *means])
    header = ["pair (layer: cut ~ kept)", "cosine", "rank: cut / control", "cut", "merged", "control cut"]
    print(markdown_table(header, rows))
    print(summary("every pair, cut", differences["cut"]))
    print(summary("every pair, merged", differences["merge"]))
    if differences["called"]:
        print(summary("near-duplicates, cut", differences["called"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["smollm2", "movie"], default="smollm2")
    parser.add_argument(
        "--pairs", type=int, default=12, help="pairs compared: the near-duplicates, then the most alike"
    )
    args = parser.parse_args()
    torch_threads()
    if args.model == "movie":
        model, validation, test = classifier("movie")
        measure("movie fixture", model, validation, test, args.pairs)
        return
    model, tokenizer = smollm2()
    model = model.to(torch.bfloat16)
    calibration = windows(tokenizer, "movie-snippets", "train[:1000]")
    heldout = windows(tokenizer, "movie-snippets", "test[:1000]")
    measure("SmolLM2-135M", model, calibration, heldout, args.pairs)


if __name__ == "__main__":
    main()
