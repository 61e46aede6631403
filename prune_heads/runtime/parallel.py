"""Data-parallel scoring on processes started by `accelerate launch` (or `prune-heads score --processes N`).

Each process takes every N-th batch; the methods' sums are added up across processes with accelerate, so
every process ends with the scores a single process computes on all the batches.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from accelerate import PartialState
from accelerate.utils import reduce


def distributed() -> PartialState | None:
    """accelerate's process state when this process is one of several (accelerate launch, torchrun), else None.

    Without CUDA the processes talk over gloo on the CPU; with it, each uses its own GPU (nccl).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    return PartialState(cpu=not torch.cuda.is_available())


def rank_and_size() -> tuple[int, int]:
    """(this process's index, number of processes); (0, 1) outside a distributed launch."""
    state = distributed()
    return (0, 1) if state is None else (state.process_index, state.num_processes)


def sum_across(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors summed over all processes (float64, on the CPU); unchanged in a single process."""
    state = distributed()
    if state is None or not tensors:
        return tensors
    flat = torch.cat([t.detach().double().reshape(-1).cpu() for t in tensors]).to(state.device)
    total = reduce(flat, reduction="sum").cpu()
    return [part.reshape(t.shape) for part, t in zip(total.split([t.numel() for t in tensors]), tensors)]


def relaunch(num_processes: int, module_args: list[str]) -> int:
    """Run `python -m prune_heads.cli <module_args>` on `num_processes` processes with `accelerate launch`
    (one per GPU with CUDA, else gloo on the CPU) and return its exit code."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(num_processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        "prune_heads.cli",
        *module_args,
    ]
    return subprocess.run(command).returncode
