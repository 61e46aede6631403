"""The default path's cost on the LLM shapes people deploy: random-weight models built from the configs of
Llama-3.2-1B, Qwen2.5-1.5B and Llama-3.1-8B (the weights random, so the cost is real and the quality
meaningless), 1/3 of the KV groups removed (the nearest reachable count), in bfloat16. Per shape: the counted
work in fisher passes (one forward and backward pass over the calibration batches) per stage, the seconds per
stage, the peak memory (CUDA: allocated above the loaded model; CPU: resident high-water mark above it) against
the weights' bytes, and the peak under onloading (`--onload`: every decoder block in CPU memory under
accelerate's offload, moved to the GPU for its passes; then the GPU holds the embeddings, the output layer and
one block's work at a time, from which a 70B's peak follows by its block's size).

Each shape runs in a fresh process. On a machine without a GPU the figures are the CPU's (say so beside them).

Run: .venv/bin/python benchmarks/cost.py [--shapes llama-3.2-1b,qwen2.5-1.5b,llama-3.1-8b] [--device cuda]
         [--batches 16 --batch-size 8 --length 256] [--onload]
One shape, its figures as a JSON line (what the table is made from, one run at a time on a lent GPU):
     .venv/bin/python benchmarks/cost.py --measure llama-3.2-1b >> cost.jsonl
     .venv/bin/python benchmarks/cost.py --table cost.jsonl
     add --profile 30 to --measure: the 30 calls with the most time, on stderr, also when a time limit stops the
     run with SIGINT (`timeout -s INT`); with CUDA_LAUNCH_BLOCKING=1 a GPU's time is charged to the call that
     asked for it, not to the next one that waits.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import pstats
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from common import PeakRSS, Timer, markdown_table, random_batches, torch_threads
from memory import SHAPES
from transformers import AutoConfig, AutoModelForCausalLM

import prune_heads as ph
from prune_heads.recovery.reconstruction import refit, refit_flops
from prune_heads.runtime.ledger import BEFORE_TUNING, Stage
from prune_heads.runtime.memory import map_large_blocks, weight_bytes
from prune_heads.scoring.recording import Moments

LLAMA_31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
CONFIGS = {  # the Hugging Face configs' shapes; weights random
    "llama-3.2-1b": ("llama", SHAPES["1b"]),
    "qwen2.5-1.5b": (
        "qwen2",
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
        ),
    ),
    "llama-3.1-8b": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            tie_word_embeddings=False,
            rope_scaling=LLAMA_31_ROPE,
            rope_theta=500000.0,
        ),
    ),
}
CONFIG = ph.PruneConfig(selection=ph.SelectionConfig(sparsity=1 / 3, round="nearest"))
STAGES = ("scoring", "selection", "tuning")


def build(shape: str, device: str, onload: bool, layers: int | None = None):
    """The random-weight model of `shape` in bfloat16 on `device` (its first `layers` blocks only, for a quick
    check); with `onload`, its decoder blocks in CPU memory under accelerate's CPU offload (each moved to the
    device for its own passes)."""
    model_type, shape_config = CONFIGS[shape]
    if layers:
        shape_config = {**shape_config, "num_hidden_layers": layers}
    config = AutoConfig.for_model(model_type, max_position_embeddings=4096, **shape_config)
    torch.manual_seed(0)
    with torch.device("cpu" if onload else device):  # drawn where it runs: an 8B's draw takes a minute on a CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    if not onload:
        return model
    from accelerate import dispatch_model

    blocks = {f"model.layers.{i}": "cpu" for i in range(config.num_hidden_layers)}
    return dispatch_model(model, device_map={"": device, **blocks}, main_device=device)


def where(device: str) -> str:
    """What a run ran on: the GPU's name, or the CPU's thread count."""
    return torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch_threads()} threads"


def refit_seconds(shape: str, device: str, count: int) -> list:
    """The first block's refit without one KV group (the search's unit), `count` groups in turn, on `device` from
    random statistics of twice as many tokens as features (its time depends on the shapes alone): the features,
    the median seconds and the counted work."""
    model = build(shape, device, onload=False, layers=1)
    layer = ph.find_attention(model)[0]
    config = model.config
    width, group = layer.num_heads * layer.head_dim, config.num_attention_heads // config.num_key_value_heads
    moments = []
    for seed in (0, 1):  # the calibration tokens' statistics and the held-out tokens'
        found = Moments(width, True, torch.float32)  # as a bfloat16 model's are kept
        found.add(torch.randn(2 * width, width, generator=torch.Generator(device).manual_seed(seed), device=device))
        moments.append(found)
    seconds = []
    for i in range(count):
        removed = list(range(i * group % layer.num_heads, i * group % layer.num_heads + group))
        with Timer() as timer:
            refit(layer, removed, *moments)
            if device == "cuda":
                torch.cuda.synchronize()
        seconds.append(timer.seconds)
    work = refit_flops([layer], {layer.name: removed}) / 1e9
    return [shape, f"{width} of which {width - group * layer.head_dim} kept", statistics.median(seconds), work]


def measure(shape: str, device: str, count: int, size: int, length: int, onload: bool, layers: int | None) -> dict:
    """One run in this process: the default path's work, seconds per stage and peak memory."""
    map_large_blocks()
    model = build(shape, device, onload, layers)
    data = random_batches(model.config.vocab_size, count, size, length, device)
    weights = weight_bytes(model)
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    with PeakRSS() as rss, Timer() as timer:
        try:
            result = ph.prune_model(model, data, CONFIG)
        except KeyboardInterrupt:  # a time limit (`timeout -s INT`): the time and the peak so far, marked stopped
            result = None
    found = {
        "shape": shape,
        "where": where(device),
        "onload": onload,
        "data": [count, size, length],
        "seconds": timer.seconds,
        "peak": torch.cuda.max_memory_allocated() - start if device == "cuda" else rss.bytes,
        "weights": weights,
        "parameters": model.num_parameters(),
        "stopped": result is None,
    }
    if result is not None:
        passes = {stage.value: result.work.passes([stage]) for stage in result.work.stages}
        stages = {k: result.timings.get(k, 0.0) for k in STAGES}
        found.update(stages=stages, passes=passes, removed=result.heads_removed)
    return found


@contextlib.contextmanager
def profiled(top: int):
    """Inside, with `top`, Python's profiler on; on the way out (an interrupt too) its `top` calls by cumulative
    time printed to stderr."""
    if not top:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        pstats.Stats(profile, stream=sys.stderr).sort_stats("cumulative").print_stats(top)


def row(found: dict) -> list[str]:
    """The table's row for one measured shape (a run a time limit stopped: its seconds and peak so far)."""
    held = "blocks onloaded" if found["onload"] else "whole"
    peak = f"{found['peak'] / 2**30:.2f} GiB ({found['peak'] / found['weights']:.0%})"
    head = [found["shape"], held, f"{found['parameters'] / 1e9:.2f}B"]
    if found.get("stopped"):
        return [*head, "-", "-", f"stopped at {found['seconds']:.0f}", peak]
    work = found["passes"]
    scoring = work.get(Stage.SCORING.value, 1.0)  # a run saved before the scoring pass was counted: fisher's one
    before = scoring + sum(work.get(s.value, 0.0) for s in BEFORE_TUNING)  # then recovery's stages
    stages = " / ".join(f"{found['stages'][k]:.0f}" for k in STAGES)
    passes = f"{before + work.get('tuning', 0.0):.1f} (search {work.get('search', 0.0):.1f})"
    return [*head, f"{found['removed']}", passes, f"{found['seconds']:.0f} ({stages})", peak]


def table(runs: list[dict]) -> str:
    """The measured shapes as a Markdown table, with what they ran on."""
    count, size, length = runs[0]["data"]
    where = "; ".join(sorted({r["where"] for r in runs}))
    head = f"Random weights (cost real, quality meaningless), bfloat16; {where}; {count} batches of {size} x {length} "
    head += "tokens; the default path at 1/3 of the KV groups (nearest reachable):\n\n"
    headers = ["shape", "held", "parameters", "heads removed", "fisher passes"]
    headers += ["seconds (scoring / selection / tuning)", "peak memory above the model (share of its weights)"]
    return head + markdown_table(headers, [row(r) for r in runs])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(CONFIGS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--onload", action="store_true", help="decoder blocks in CPU memory, onloaded")
    parser.add_argument("--layers", type=int, default=None, help="only the first N blocks (a quick check)")
    parser.add_argument("--measure", default=None, help="one shape, in this process: its figures as a JSON line")
    parser.add_argument("--table", default=None, help="the table from a file of --measure's lines")
    parser.add_argument("--profile", type=int, default=0, help="with --measure: the N calls with the most time")
    parser.add_argument("--refits", type=int, default=0, help="time N refits at each shape instead")
    args = parser.parse_args()
    shape = (args.batches, args.batch_size, args.length)
    if args.table:
        lines = Path(args.table).read_text().splitlines()
        print(table([json.loads(line) for line in lines if line.strip()]))
        return
    if args.refits:
        found = [refit_seconds(name, args.device, args.refits) for name in args.shapes.split(",")]
        print(f"One refit without one KV group of the first block, median of {args.refits}; {where(args.device)}:\n")
        print(markdown_table(["shape", "output-projection inputs", "seconds", "counted GFLOPs"], found))
        return
    if args.measure:
        with profiled(args.profile):
            found = measure(args.measure, args.device, *shape, args.onload, args.layers)
        print(json.dumps(found))
        return
    runs = []
    for name in args.shapes.split(","):
        command = [sys.executable, __file__, "--measure", name, "--device", args.device]
        command += ["--batches", str(args.batches), "--batch-size", str(args.batch_size), "--length", str(args.length)]
        command += ["--onload"] if args.onload else []
        command += ["--layers", str(args.layers)] if args.layers else []
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(name, runs[-1], file=sys.stderr, flush=True)
    print(table(runs))


if __name__ == "__main__":
    main()
