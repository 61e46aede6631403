"""Peak memory and time of the default path (`ph.prune_model`) against one fisher scoring pass, on a
random-weight Llama-style model with grouped-query attention large enough that its weights dominate
(TinyLlama's layer shape: hidden 2048, 32 query and 4 KV heads; 16 layers, 0.8B parameters), and against
the earlier flow that tuned a pruned model against a second, unpruned copy. On CUDA: peak allocated memory; on the CPU: peak resident memory (sampled). Each measurement is
above the memory held before it (the weights), as a fraction of the weight bytes.

Run: .venv/bin/python benchmarks/memory.py [--device cuda] [--dtype bfloat16] [--layers 16]
"""

from __future__ import annotations

import argparse
import copy
import gc
from contextlib import contextmanager

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import prune_heads as ph
from common import PeakRSS, Timer, markdown_table, torch_threads


def llama(layers: int, dtype: torch.dtype, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=32000)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def batches(device: str, count: int = 10, size: int = 1, length: int = 128) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(3, 32000, (size, length), generator=g)
        out.append({"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
                    "labels": ids.to(device)})
    return out


@contextmanager
def peak(device: str):
    """Yields a dict whose "bytes" is set, on exit, to the peak memory above what was held on entry."""
    result = {}
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        yield result
        torch.cuda.synchronize()
        result["bytes"] = torch.cuda.max_memory_allocated() - start
    else:
        with PeakRSS() as rss:
            yield result
        result["bytes"] = rss.bytes


def copy_then_tune(model, data, config):
    """The earlier flow: a full unpruned copy as the reference, the pruned model tuned against it."""
    reference = copy.deepcopy(model)
    scores = ph.score_heads(model, data, method="fisher", progress=False)
    ph.prune(model, ph.select_heads(scores, **config.selection.budget()))
    ph.tune_gates(model, reference, data, epochs=1, bias_lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    data = batches(args.device)
    config = ph.PruneConfig(selection=ph.SelectionConfig(num_heads=8 * args.layers))  # a KV group of 4 per layer
    runs = {
        "one fisher scoring pass": lambda m: ph.score_heads(m, data, method="fisher", progress=False),
        "**default path** (`ph.prune_model`, tuned on the gated model)": lambda m: ph.prune_model(
            m, data, config, progress=False),
        "earlier flow: a copy of the model as the reference": lambda m: copy_then_tune(m, data, config),
    }
    rows, weights = [], None
    warm = llama(1, dtype, args.device)  # the first pass in a process allocates kernels' workspaces: not ours
    ph.score_heads(warm, data[:1], method="fisher", progress=False)
    del warm
    for name, run in runs.items():
        model = llama(args.layers, dtype, args.device)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        with peak(args.device) as memory, Timer() as t:
            run(model)
        rows.append([name, f"{memory['bytes'] / 2**20:.0f} MiB", f"{memory['bytes'] / weights:.1%}", f"{t.seconds:.1f}"])
        print(rows[-1], flush=True)
        del model
    base = float(rows[0][2].rstrip("%")) / 100
    for row in rows:
        row.insert(3, f"{float(row[2].rstrip('%')) / 100 - base:+.1%}")
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch_threads()} threads"
    print(f"\nRandom-weight Llama ({args.layers} layers x 32 heads, 4 KV heads, hidden 2048; {weights / 2**30:.2f} GiB of "
          f"{args.dtype} weights), 10 batches of 1 x 128 tokens, {device}; 1/4 of the KV groups removed:\n")
    print(markdown_table(["run", "peak above the weights", "as a share of the weights", "vs one scoring pass",
                          "seconds"], rows))


if __name__ == "__main__":
    main()
