"""Issue 4 benchmark: measured speed-up of a BERT-base-sized model (random weights) after removing 25/50/75%
of its 144 heads, next to the ceiling its FLOPs allow. All four models are timed in turns in one run.

Run: .venv/bin/python benchmarks/speed.py [--batch-size 32 --seq-len 128 --repeats 5 --device cpu]
"""

from __future__ import annotations

import argparse

import torch
from common import markdown_table
from transformers import BertConfig, BertModel

import prune_heads as ph
from prune_heads.evaluation.speed import benchmark

FRACTIONS = (0.25, 0.5, 0.75)


def bert_base(attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = BertConfig()  # 12 layers x 12 heads, hidden 768: BERT-base
    config._attn_implementation = attn
    return BertModel(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    args = parser.parse_args()
    models = [bert_base(args.attn)]
    for fraction in FRACTIONS:
        model = bert_base(args.attn)
        keep = round(12 * (1 - fraction))
        ph.prune(model, {i: list(range(keep, 12)) for i in range(12)})  # the same count in every layer
        models.append(model)
    results = benchmark(
        models,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        repeats=args.repeats,
        warmup=1,
        device=args.device,
        dtype=getattr(torch, args.dtype),
    )
    base = results[0]
    rows = []
    for fraction, result in zip((0.0, *FRACTIONS), results):
        rows.append(
            [
                f"{fraction:.0%}",
                sum(l.num_heads for l in ph.find_attention(models[len(rows)])),
                f"{result['parameters'] / 1e6:.1f} M",
                f"{result['flops'] / 1e9:.1f}",
                f"{result['latency_ms']:.0f}",
                f"{result['latency_p90_ms']:.0f}",
                f"{base['latency_ms'] / result['latency_ms']:.2f}x",
                f"{base['flops'] / result['flops']:.2f}x",
            ]
        )
    s = base["settings"]
    print(
        f"BERT-base (random weights), {args.attn} attention, batch {s['batch_size']}, sequence {s['seq_len']}, "
        f"{s['device']}, {s['dtype']}, {s['threads']} threads, median of {s['repeats']} runs (in turns):\n"
    )
    print(
        markdown_table(
            [
                "heads removed",
                "heads",
                "parameters",
                "GFLOPs",
                "latency ms",
                "p90 ms",
                "measured speed-up",
                "FLOPs ceiling",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
