"""Cost at scale: peak memory and time of the default path (`ph.prune_model`, 1/4 of the heads as whole KV
groups) against one fisher scoring pass over the same batches, on random-weight Llama-shaped models from 135M
to 1.2B parameters (the shapes of SmolLM2-135M, SmolLM2-360M and Llama-3.2-1B), float32 and bfloat16.

Each run is a fresh process, its C allocator set as the `prune-heads` command sets it (`--allocator command`:
`map_large_blocks`, glibc mapping every block of 256 KiB or more on its own) or left at glibc's default
(`--allocator library`, what a caller of the API gets unless it calls `map_large_blocks` itself). On the CPU
the peak is the kernel's resident high-water mark (VmHWM), reset once the model and the batches are loaded,
minus the resident memory then; on CUDA, peak allocated memory above what was allocated. Both are set against
the weights' bytes.

Run: .venv/bin/python benchmarks/memory.py [--sizes 135m,360m,1b] [--dtypes float32,bfloat16]
         [--batches 16 --batch-size 2 --length 256] [--allocator command|library] [--device cuda]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys

import torch
from common import PeakRSS, Timer, markdown_table, random_batches, torch_threads
from transformers import LlamaConfig, LlamaForCausalLM

import prune_heads as ph
from prune_heads.runtime.memory import map_large_blocks

SHAPES = {  # Hugging Face configs of the real models, weights random
    "135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    "360m": dict(
        hidden_size=960,
        intermediate_size=2560,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        head_dim=64,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rope_theta=500000.0,
    ),
}
CONFIG = ph.PruneConfig(selection=ph.SelectionConfig(sparsity=0.25, round="nearest"))


def measure(
    kind: str, size: str, dtype: str, device: str, batches: int, batch_size: int, length: int, allocator: str
) -> dict:
    """One run in this process: the allocator set (`allocator` "command" as `prune-heads` sets it), the model
    and batches built, then `kind` ("fisher" or "default") timed with its peak memory above what was held
    before it."""
    if allocator == "command":
        map_large_blocks()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=4096, **SHAPES[size]))
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
    data = random_batches(model.config.vocab_size, batches, batch_size, length, device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    with PeakRSS() as rss, Timer() as timer:
        if kind == "fisher":
            ph.score_heads(model, data, method="fisher", progress=False)
        else:
            result = ph.prune_model(model, data, CONFIG, progress=False)
    if device == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start if device == "cuda" else rss.bytes
    out = {"seconds": timer.seconds, "peak": peak, "weights": weights, "parameters": model.num_parameters()}
    if kind == "default":
        out["work"] = result.work.as_dict()
        out["epochs"] = next((e["epochs_run"] for e in result.recovery if "tuning" in e["step"]), 0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="135m,360m,1b")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--allocator", choices=("command", "library"), default="command")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # kind,size,dtype: one run, in-process
    args = parser.parse_args()
    shape = (args.batches, args.batch_size, args.length)
    if args.measure:
        kind, size, dtype = args.measure.split(",")
        print(json.dumps(measure(kind, size, dtype, args.device, *shape, args.allocator)))
        return
    rows = []
    for size in args.sizes.split(","):
        for dtype in args.dtypes.split(","):
            found = {}
            for kind in ("fisher", "default"):
                command = [
                    sys.executable,
                    __file__,
                    "--measure",
                    f"{kind},{size},{dtype}",
                    "--device",
                    args.device,
                    "--batches",
                    str(args.batches),
                    "--batch-size",
                    str(args.batch_size),
                    "--length",
                    str(args.length),
                    "--allocator",
                    args.allocator,
                ]
                found[kind] = json.loads(
                    subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
                )
                print(size, dtype, kind, found[kind], flush=True)
            fisher, default = found["fisher"], found["default"]
            weights = fisher["weights"]
            rows.append(
                [
                    f"{fisher['parameters'] / 1e6:.0f}M",
                    dtype,
                    f"{weights / 2**30:.2f}",
                    f"{fisher['seconds']:.0f}",
                    f"{default['seconds']:.0f} ({default['epochs']} ep)",
                    f"{default['seconds'] / fisher['seconds']:.2f}x",
                    f"{fisher['peak'] / 2**20:.0f} MiB ({fisher['peak'] / weights:.1%})",
                    f"{default['peak'] / 2**20:.0f} MiB ({default['peak'] / weights:.1%})",
                    f"{(default['peak'] - fisher['peak']) / weights:+.1%}",
                ]
            )
    device = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"CPU, {torch_threads()} threads, allocator as the {args.allocator} leaves it"
    )
    print(
        f"\nRandom-weight Llama shapes, {args.batches} batches of {args.batch_size} x {args.length} tokens, {device}; "
        f"the default path removes 1/4 of the heads as whole KV groups (the nearest reachable count):\n"
    )
    print(
        markdown_table(
            [
                "parameters",
                "dtype",
                "weights GiB",
                "fisher pass s",
                "default path s",
                "time vs the pass",
                "fisher pass peak above the weights",
                "default path peak",
                "difference, share of the weights",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
