"""The heal's cost: tokens a second of `recovery.heal`'s training loop (transformers' Trainer, the teacher's forward
and the student's forward and backward, the whole vocabulary's KL) on an LLM shape with random weights (the cost is
real, the quality meaningless), a third of its KV groups removed, every weight trained (float32 master copies)
or LoRA adapters (`--heal-rank`), and the counted FLOPs a token; where no GPU is lent, the tokens a second an
H100 gives, predicted from those FLOPs and the H100's measured bfloat16 pass rate (benchmarks/cost_model.py).
Its quality on real models is benchmarks/frontier.py's ("default, healed 250k", "default, healed 1M").

Run: .venv/bin/python benchmarks/heal.py [--shape smollm2-135m] [--steps 12] [--rank 0 --rank 64] [--device cuda]
     .venv/bin/python benchmarks/heal.py --predict llama-3.1-8b
(SmolLM2's shape on 2 cores: about 2 minutes a row.)
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch
from common import markdown_table, random_batches, torch_threads
from cost_model import H100, config
from transformers import AutoModelForCausalLM

import prune_heads as ph
from prune_heads.recovery.heal import HealData, Settings, heal_data, train
from prune_heads.runtime.devices import native_bfloat16
from prune_heads.runtime.work import Pricer

BATCH, LENGTH = 8, 256  # the README's SmolLM2 command's batches


def pruned_pair(shape: str, device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the unpruned model, a copy with the first third of every layer's KV groups removed), random weights in
    bfloat16 where the device multiplies it natively (as the CLI loads an LLM), else float32."""
    dtype = torch.bfloat16 if native_bfloat16(device) else torch.float32
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(config(shape), dtype=dtype).to(device).eval()
    student = copy.deepcopy(teacher)
    layers = ph.find_attention(student)
    groups = round(layers[0].num_kv_heads / 3) or 1
    ph.prune(student, {l.index: list(range(groups * l.group_size)) for l in layers})
    return teacher, student


def flops_per_token(teacher, student, rank: int, device: str) -> float:
    """Counted FLOPs of a heal token: the teacher's forward, the student's forward and its backward (twice a
    forward for every weight, once for adapters), as the flow's ledger counts them."""
    one = random_batches(teacher.config.vocab_size, 1, 1, LENGTH, device)[0]
    one = {k: v for k, v in one.items() if k != "labels"}
    backward = 1 if rank else 2
    return Pricer.of(teacher, one).per_position + (1 + backward) * Pricer.of(student, one).per_position


def measure(shape: str, rank: int, steps: int, device: str) -> list:
    """One row: the shape, what trains, the tokens a second over `steps` steps (the Trainer's start included), the
    counted FLOPs a token and the FLOPs a second they make."""
    teacher, student = pruned_pair(shape, device)
    batches = random_batches(teacher.config.vocab_size, 2, BATCH, LENGTH, device)
    data: HealData = heal_data(batches, [], steps * BATCH * LENGTH, False, None)
    settings = Settings(seed=0, folder=None, every=10**9, resume=False, progress=True, rank=rank)
    tick = time.perf_counter()
    train(student, teacher, data, settings, "benchmark")
    seconds = time.perf_counter() - tick
    rate = data.tokens / seconds
    flops = flops_per_token(teacher, student, rank, device)
    what = f"LoRA rank {rank}" if rank else "every weight"
    return [shape, what, data.tokens, f"{rate:.0f}", f"{flops / 1e9:.2f}", f"{rate * flops / 1e12:.2f}"]


def predict(shape: str) -> list:
    """The H100's tokens a second for a heal of `shape` with adapters and a third of its KV groups removed: the
    FLOPs a token (2 a weight a token multiplies by: the teacher's forward, the student's forward and its
    activations' backward) over the H100's measured bfloat16 pass rate; and every weight's Adam state beside it."""
    found = config(shape)
    h, i, n, vocab = found.hidden_size, found.intermediate_size, found.num_hidden_layers, found.vocab_size
    attention = 2 * h * h + 2 * h * found.num_key_value_heads * (h // found.num_attention_heads)
    teacher = n * (attention + 3 * h * i) + vocab * h  # the output layer multiplies; the embedding is looked up
    student = teacher - n * attention / 3
    weights = student + (0 if found.tie_word_embeddings else vocab * h)
    flops = 2 * teacher + 4 * student
    every = f"every weight: {16 * weights / 2**30:.0f} GiB of float32 weights, gradients and Adam state"
    return [shape, f"LoRA ({every})", "-", f"{H100.pass_flops / flops:.0f}", f"{flops / 1e9:.1f}", "-"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rank", type=int, action="append", help="0: every weight; R: LoRA rank R (repeatable)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--predict", default=None, help="a shape whose H100 rate to predict")
    args = parser.parse_args()
    header = ["shape", "trains", "tokens", "tokens / s", "GFLOPs / token", "TFLOP/s"]
    if args.predict:
        print(markdown_table(header, [predict(args.predict)]))
        print(f"\n{H100.name}: {H100.source}")
        return
    rows = [measure(args.shape, rank, args.steps, args.device) for rank in args.rank or [0, 64]]
    print(markdown_table(header, rows))
    print(f"\n{args.device}, {torch_threads()} threads; every row's Trainer start and first steps included")
    assert all(math.isfinite(float(r[3])) for r in rows)


if __name__ == "__main__":
    main()
