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
The cost model (benchmarks/cost_model.py): each shape's counted work on its narrow proxy, then the predicted
minutes on 1, 4 and 8 GPUs from a device's rates (the H100's measured figures unless --device-rates is given):
     .venv/bin/python benchmarks/cost.py --count llama-3.1-8b >> benchmarks/cost-counts.jsonl
     .venv/bin/python benchmarks/cost.py --predict benchmarks/cost-counts.jsonl [--device-rates rates.json]
     .venv/bin/python benchmarks/cost.py --rates --device cuda > rates.json   (on a lent GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from common import PeakRSS, Timer, markdown_table, random_batches, torch_threads
from cost_model import CONFIG, H100, Counted, Device, config, count, predict, structure
from transformers import AutoModelForCausalLM

import prune_heads as ph
from prune_heads.recovery.reconstruction import refit, refit_flops
from prune_heads.runtime.ledger import BEFORE_TUNING, Stage
from prune_heads.runtime.memory import map_large_blocks, weight_bytes
from prune_heads.scoring.recording import Moments

STAGES = ("scoring", "selection", "tuning")
MEASURED = "llama-3.2-1b,qwen2.5-1.5b,llama-3.1-8b"  # the shapes a GPU's run holds whole
PROCESSES = (1, 4, 8)


def build(shape: str, device: str, onload: bool, layers: int | None = None):
    """The random-weight model of `shape` in bfloat16 on `device` (its first `layers` blocks only, for a quick
    check); with `onload`, its decoder blocks in CPU memory under accelerate's CPU offload (each moved to the
    device for its own passes)."""
    found = config(shape, **({"num_hidden_layers": layers} if layers else {}))
    torch.manual_seed(0)
    with torch.device("cpu" if onload else device):  # drawn where it runs: an 8B's draw takes a minute on a CPU
        model = AutoModelForCausalLM.from_config(found, dtype=torch.bfloat16).eval()
    if not onload:
        return model
    from accelerate import dispatch_model

    blocks = {f"model.layers.{i}": "cpu" for i in range(found.num_hidden_layers)}
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
    shape_config = model.config
    width = layer.num_heads * layer.head_dim
    group = shape_config.num_attention_heads // shape_config.num_key_value_heads
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


def synchronized(device: str) -> None:
    """Wait for the device's queued work (a GPU's), so a timer around it measures it."""
    if device == "cuda":
        torch.cuda.synchronize()


def pass_rate(shape: str, device: str, size: int, length: int) -> float:
    """bfloat16 FLOPs a second of a fisher pass (forward and backward) on `device`: the shape's first block with
    its embeddings and output layer, over `size` x `length` random tokens, the second of two runs timed."""
    model = build(shape, device, onload=False, layers=1)
    ids = random_batches(model.config.vocab_size, 1, size, length, device)[0]["input_ids"]
    for _ in range(2):
        synchronized(device)
        with Timer() as timer:
            model(input_ids=ids, labels=ids).loss.backward()
            synchronized(device)
    return 6 * structure(shape, layers=1).matmul_parameters * size * length / timer.seconds


def copy_rate(source: str, device: str, size: int = 2**30) -> float:
    """Bytes a second copied from `source` to `device` (pinned where the source is the CPU and the device a
    GPU), the second of two copies timed."""
    tensor = torch.empty(size, dtype=torch.uint8, device=source)
    tensor = tensor.pin_memory() if source == "cpu" and device == "cuda" else tensor
    for _ in range(2):
        synchronized(device)
        with Timer() as timer:
            tensor.to(device, copy=True)
            synchronized(device)
    return size / timer.seconds


def rates(device: str, size: int, length: int) -> Device:
    """This device's `Device` rates, measured (the prepared device check): a fisher pass's on the 8B shape's
    block, the refits' from `refit_seconds`, the copies' (the peer link: the H100's assumed figure)."""
    shape = "llama-3.1-8b"
    seconds = refit_seconds(shape, device, 2)[2]
    memory = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else 0
    return Device(
        name=where(device),
        pass_flops=pass_rate(shape, device, size, length),
        refit_flops=structure(shape).refit_flops / seconds,
        memory=memory or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        host_bytes=copy_rate("cpu", device),
        peer_bytes=H100.peer_bytes,
        memory_bytes=2 * copy_rate(device, device),  # a copy reads and writes each byte
        source=f"measured on {where(device)}; peer link assumed",
    )


def predicted(counts: list[Counted], device: Device, size: int, length: int) -> str:
    """The cost model's table: each counted shape on 1, 4 and 8 of `device`'s GPUs, its terms in minutes."""
    rows = []
    for counted in counts:
        shape = structure(counted.shape)
        for processes in PROCESSES:
            found = predict(shape, counted, device, processes, size, length)
            held = "onloaded" if found.onloaded else "whole"
            terms = [found.passes, found.refits, found.summing, found.onloading, found.writing, found.total]
            passes = sum(counted.passes.values())
            head = [counted.shape, processes, held, f"{passes:.1f} (search {counted.passes.get('search', 0):.1f})"]
            rows.append([*head, counted.refits, *(f"{t / 60:.1f}" for t in terms)])
    headers = ["shape", "GPUs", "held", "fisher passes", "refits", "passes", "refits, every GPU", "summing"]
    headers += ["onloading", "guard's text", "predicted minutes"]
    return f"{device.name}: {device.source}; {size} x {length} tokens a batch:\n\n" + markdown_table(headers, rows)


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
    parser.add_argument("--shapes", default=MEASURED)
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
    parser.add_argument("--count", default=None, help="one shape's counted work on its proxy, as a JSON line")
    parser.add_argument("--proxy-length", type=int, default=32, help="with --count: the proxy's tokens a row")
    parser.add_argument("--whole-width", action="store_true", help="with --count: the shape itself, no proxy")
    parser.add_argument("--rates", action="store_true", help="this device's rates, as a JSON line")
    parser.add_argument("--predict", default=None, help="the cost model's table from a file of --count's lines")
    parser.add_argument("--device-rates", default=None, help="with --predict: a file of --rates's line")
    args = parser.parse_args()
    shape = (args.batches, args.batch_size, args.length)
    if args.count:
        print(
            json.dumps(
                dataclasses.asdict(
                    count(args.count, args.batches, args.batch_size, args.proxy_length, not args.whole_width)
                )
            )
        )
        return
    if args.rates:
        print(json.dumps(dataclasses.asdict(rates(args.device, args.batch_size, args.length))))
        return
    if args.predict:
        counts = [Counted(**json.loads(line)) for line in Path(args.predict).read_text().splitlines() if line]
        device = Device(**json.loads(Path(args.device_rates).read_text())) if args.device_rates else H100
        print(predicted(counts, device, args.batch_size, args.length))
        return
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
