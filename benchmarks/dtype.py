"""The default path in another weight type, judged in float32: perplexity on the calibration's domain and on
another, against the unpruned float32 model, with 95% paired intervals (no lm-eval: the quick check of a dtype;
`frontier.py --dtype` runs the whole cell); `--general weigh` with every decision weighing the model's own text,
`--epochs 0` without tuning (what each step does to the calibration's text and the model's own).

    .venv/bin/python benchmarks/dtype.py --model gemma3 --depth 1/3 --dtype bfloat16 [--general weigh] [--epochs 0]
"""

from __future__ import annotations

import argparse
import copy

import frontier
import torch
from common import Timer
from llm import windows

import prune_heads as ph
from prune_heads.config import GENERAL_MODES
from prune_heads.evaluation.task import evaluation


def perplexities(model, texts: dict) -> dict:
    """Per-window perplexity statistics of `model` on each text."""
    return {name: evaluation(model, data, progress=False).statistics["perplexity"] for name, data in texts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(frontier.MODELS), default="smollm2")
    parser.add_argument("--depth", choices=list(frontier.DEPTHS), default="1/3")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--general", choices=GENERAL_MODES, default="report", help="recovery.general")
    parser.add_argument("--epochs", type=int, default=ph.RecoveryConfig().epochs, help="recovery.epochs")
    args = parser.parse_args()
    base, tokenizer = frontier.MODELS[args.model]()
    calibration = windows(tokenizer, "movie-snippets", "train[:1000]")
    texts = {name: windows(tokenizer, f"{name}-snippets", "test[:1000]") for name in ("movie", "tweet")}
    before = perplexities(base, texts)
    layers = ph.find_attention(base)
    groups = {"min_heads_per_layer": 0} if all(l.num_kv_heads == 1 for l in layers) else {}
    model = torch.nn.Module.to(copy.deepcopy(base), getattr(torch, args.dtype))  # transformers refuses a GGUF's
    with Timer() as timer:
        heads = round(sum(l.num_heads for l in layers) * frontier.DEPTHS[args.depth])
        recovery = {"general": args.general, "epochs": args.epochs}
        found = frontier.default(model, calibration, heads, recovery=recovery, **groups)
    after = perplexities(torch.nn.Module.to(model, torch.float32), texts)
    passes = found["fisher_passes"]
    print(f"{args.model} at {args.depth} in {args.dtype}: {timer.seconds:.0f} s, {passes:.2f} fisher passes")
    print(f"  held-out: {found['heldout']}; kept: {found['kept']}")
    for name in texts:
        change = frontier.percent_change(before[name], after[name])
        print(f"  {name}: {change['percent']:+.1f}% ({change['low']:+.1f} to {change['high']:+.1f})")


if __name__ == "__main__":
    main()
