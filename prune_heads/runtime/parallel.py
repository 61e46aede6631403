"""Data-parallel work on processes started by `accelerate launch` (or `prune-heads score|prune --processes N`).

Scoring gives each process every N-th batch and adds the methods' sums up across processes. The rest of the
pruning flow gives each process its rows of every batch (`Shards`), so every list of batches and every price
stays the same on every process: statistics are summed (`sum_across`), per-example values gathered back into
the batches' order (`Shards.gathered`) and tuning's gradients summed (`sum_gradients`), so every process makes
the decisions a single process makes on all the rows.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.utils import reduce

from ..errors import ConfigError

CHUNK = 2**25  # float64 values summed across processes at once (256 MiB): a 70B's statistics are 40 GiB


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


def is_main() -> bool:
    """Whether this process writes what the run makes (the first of several; the only one otherwise)."""
    return rank_and_size()[0] == 0


def sum_across(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors summed over all processes (float64, on the CPU); unchanged in a single process. Summed
    `CHUNK` values at a time, so a big model's statistics are not copied whole at once."""
    state = distributed()
    if state is None or not tensors:
        return tensors
    return [total for group in _chunks(tensors) for total in _summed(group, state.device)]


def _chunks(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` in order, in runs of at most `CHUNK` values (a larger tensor alone)."""
    runs: list[list[torch.Tensor]] = [[]]
    for t in tensors:
        if runs[-1] and sum(x.numel() for x in runs[-1]) + t.numel() > CHUNK:
            runs.append([])
        runs[-1].append(t)
    return runs


def _summed(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    flat = torch.cat([t.detach().double().reshape(-1).cpu() for t in tensors]).to(device)
    total = reduce(flat, reduction="sum").cpu()
    return [part.reshape(t.shape) for part, t in zip(total.split([t.numel() for t in tensors]), tensors)]


def any_across(flag: bool) -> bool:
    """Whether `flag` holds on any process (`flag` in a single process)."""
    return bool(sum_across([torch.tensor([float(flag)])])[0].item())


def check_shares(batches: list[dict], what: str) -> None:
    """Refuse more processes than the batches hold rows (a process would run nothing)."""
    rows, size = sum(_rows(b) for b in batches), rank_and_size()[1]
    if rows < size:
        raise ConfigError(
            f"{size} data-parallel processes share {rows} {what} examples: run at most {rows} processes "
            "(--processes), or give more examples"
        )


def _rows(batch: dict) -> int:
    return next(v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.dim())


def share(count: int, offset: int = 0) -> slice:
    """This process's contiguous share of `count` items dealt over the processes in turn from process `offset`
    on: where they do not divide, the first processes dealt to take one more each (a process may take none)."""
    rank, size = rank_and_size()
    each, extra = divmod(count, size)
    place = (rank - offset) % size  # this process's place in the order the items are dealt in
    start = place * each + min(place, extra)
    return slice(start, start + each + (place < extra))


def joined(part: torch.Tensor) -> torch.Tensor:
    """Every process's `part` (its `share` of some rows, on the CPU) joined in process order: all the rows, on
    every process; `part` itself in a single process. Every process must call it (a collective)."""
    size = rank_and_size()[1]
    if size == 1:
        return part
    everyone: list = [None] * size
    dist.all_gather_object(everyone, part.detach().cpu())
    return torch.cat(everyone)


def _offset(batch: dict) -> int:
    """The first process to take one more of the batch's rows: from its integer tensors (the tokens), the same
    on every process that holds the same batch, so small batches spread over every process and any list holding
    the batch cuts it the same way."""
    tokens = [v for _, v in sorted(batch.items()) if torch.is_tensor(v) and not v.is_floating_point()]
    return int(tokens[0].long().sum()) % rank_and_size()[1] if tokens else 0


def _cut(batch: dict, span: slice) -> dict:
    rows = _rows(batch)
    return {k: v[span] if torch.is_tensor(v) and v.dim() and v.shape[0] == rows else v for k, v in batch.items()}


class Shards:
    """This process's rows of a list of batches: `local`, the batches it holds rows of (cut to those rows; all
    of them, whole, in a single process) and `index`, their places in the list. `spread` and `gathered` map
    per-batch values between the local batches and the whole list."""

    def __init__(self, batches: list[dict]) -> None:
        self.count = len(batches)
        if rank_and_size()[1] == 1:
            self.local, self.index, self.offsets = list(batches), list(range(len(batches))), [0] * len(batches)
            return
        self.offsets = [_offset(b) for b in batches]
        spans = [share(_rows(b), offset) for b, offset in zip(batches, self.offsets)]  # see `_offset`
        self.index = [i for i, span in enumerate(spans) if span.stop > span.start]
        self.local = [_cut(batches[i], spans[i]) for i in self.index]

    def mine(self, values: list) -> list:
        """The items of a whole-list `values` (one per batch) at the local batches."""
        return [values[i] for i in self.index]

    def spread(self, values: list) -> list:
        """Per-local-batch `values` in a list as long as the batches, None where this process holds no rows."""
        spread: list = [None] * self.count
        for i, value in zip(self.index, values):
            spread[i] = value
        return spread

    def gathered(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per batch, every process's `values` (one per local batch, on the CPU) joined in the batch's row
        order (batches no process gave a value for left out); `values` themselves in a single process. Every
        process must call it (a collective)."""
        size = rank_and_size()[1]
        if size == 1:
            return values
        everyone: list = [None] * size
        dist.all_gather_object(everyone, dict(zip(self.index, (v.detach().cpu() for v in values))))
        joined = []
        for i, first in enumerate(self.offsets):  # the rows are dealt from process `first` on (`share`)
            parts = [everyone[(first + place) % size].get(i) for place in range(size)]
            if any(part is not None for part in parts):
                joined.append(torch.cat([part for part in parts if part is not None]))
        return joined


def same_everywhere(description: str, batches: list[dict]) -> None:
    """Refuse a run whose processes hold different `description`s (model and config) or batches."""
    if rank_and_size()[1] == 1:
        return
    digest = hashlib.sha256(description.encode())
    for batch in batches:
        for key, value in sorted(batch.items()):
            digest.update(key.encode())
            if torch.is_tensor(value):
                digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    everyone: list = [None] * rank_and_size()[1]
    dist.all_gather_object(everyone, digest.hexdigest())
    if len(set(everyone)) > 1:
        raise ConfigError(
            "the data-parallel processes hold different models, configs or data: give every process the same "
            "model, recipe, data and seed"
        )


def sum_gradients(params: list[torch.Tensor]) -> None:
    """Each parameter's gradient summed over the processes, in place (one that had no rows to run adds
    zeros); nothing in a single process."""
    if rank_and_size()[1] == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    for p, total in zip(params, sum_across(grads)):
        p.grad = total.to(p)


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
