"""Work, counted rather than timed: the budgets of the pruning flow are FLOPs derived from the model and the
data, so the same inputs, config and seed give the same model on an idle or a busy machine, a laptop or a GPU.

A forward pass's FLOPs are counted once, by torch's FLOP counter, on one example of the first batch; every
other pass is priced from that count by its positions (rows x sequence length). Fused attention is counted as
its two products whatever kernel runs it (the CPU's flash kernel, which torch's counter skips, and grouped-query
key and value heads, which older counters refuse), so a model counts the same on every device. A backward pass
through the gates (parameters frozen, so only activation gradients) is priced as one more forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


def positions(batch: dict) -> int:
    """Rows x length of the batch's first input tensor with two or more dimensions (its rows when it has none):
    what a forward pass's cost grows with (tokens for text; examples for images and audio)."""
    tensors = [v for k, v in batch.items() if torch.is_tensor(v) and v.dim() and k != "labels"]
    shaped = next((t for t in tensors if t.dim() >= 2), None)
    return int(shaped.shape[0] * shaped.shape[1]) if shaped is not None else int(tensors[0].shape[0])


def _attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """Fused attention's FLOPs from its shapes ([batch, heads, length, head dim]): the scores and the weighted
    values, as two batched products over the query's heads (grouped key and value heads broadcast)."""
    batch, heads, length, dim = query
    return 2 * batch * heads * length * key[-2] * (dim + value[-1])


_FUSED_ATTENTION = [
    getattr(torch.ops.aten, name)
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
]


def _counted(model: nn.Module, inputs: dict[str, torch.Tensor]) -> FlopCounterMode:
    """torch.utils.flop_counter's counts of one forward pass (matmuls, convolutions, attention), per module."""
    fused = dict.fromkeys(_FUSED_ATTENTION, _attention_flops)
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=fused) as counter:
        model(**inputs)
    return counter


def count_flops(model: nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """FLOPs of one forward pass, counted by torch.utils.flop_counter (matmuls, convolutions, attention)."""
    return int(_counted(model, inputs).get_total_flops())


def first_example(batch: dict) -> dict:
    """The batch cut to its first example (labels dropped): what a pass is priced from."""
    rows = next(v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.dim())
    return {
        k: v[:1] if torch.is_tensor(v) and v.dim() and v.shape[0] == rows else v
        for k, v in batch.items()
        if k != "labels"
    }


def module_shares(model: nn.Module, batch: dict, modules: list[nn.Module]) -> list[float] | None:
    """Each module's share of a forward pass's FLOPs, counted on the first example of `batch`; None where
    the counter names one of them otherwise than by its path in the model (so it cannot be priced)."""
    counter = _counted(model, first_example(batch))
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    paths = {id(m): name for name, m in model.named_modules()}
    names = [f"{type(model).__name__}.{paths.get(id(m))}" for m in modules]
    total = counter.get_total_flops()
    if not total or any(name not in counts for name in names):
        return None
    return [counts[name] / total for name in names]


@dataclass(frozen=True)
class Pricer:
    """The price of passes over batches, in FLOPs: `per_position` forward FLOPs per position."""

    per_position: float

    @classmethod
    def of(cls, model: nn.Module, batch: dict) -> Pricer:
        """Count one forward pass of `model` on the first example of `batch` (labels dropped)."""
        one = first_example(batch)
        return cls(count_flops(model, one) / max(positions(one), 1))

    def forward(self, batches: Iterable[dict]) -> float:
        """FLOPs of one forward pass over the batches."""
        return self.per_position * sum(positions(b) for b in batches)

    def forward_backward(self, batches: Iterable[dict]) -> float:
        """FLOPs of one forward and one backward pass through the gates over the batches."""
        return 2 * self.forward(batches)


@dataclass
class WorkLimit:
    """A limit on counted work: `limit` FLOPs, of which `spent` are used; `step` prices one tuning step on a
    batch and `check` one held-out check."""

    limit: float
    pricer: Pricer
    check: float
    spent: float = 0.0

    def step(self, batch: dict) -> float:
        return self.pricer.forward_backward([batch])

    def allows(self, cost: float) -> bool:
        """Whether `cost` more FLOPs stay within the limit."""
        return self.spent + cost <= self.limit
