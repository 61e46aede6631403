"""Per-head gates: multiply each head's output by a value, on any attention backend."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .hooks import hooks
from .layers import AttentionLayer, find_attention, output_projection, resolve


class HeadGates(list):
    """One float32 gate tensor per attention layer, in `find_attention` order.

    Each entry is [num_heads] (one gate per head) or [batch, num_heads] (one gate per example and head,
    which gives per-example gradients in one backward pass). Entries may be replaced while the context is
    open; the hooks read them at call time. `layers` holds the layers the gates belong to.
    """

    def __init__(self, layers: list[AttentionLayer], tensors: list[torch.Tensor]) -> None:
        super().__init__(tensors)
        self.layers = layers

    def reset(self, batch_size: int | None = None, requires_grad: bool = True) -> None:
        """Set every gate back to ones: [num_heads], or [batch_size, num_heads] when batch_size is given."""
        for i, layer in enumerate(self.layers):
            shape = (layer.num_heads,) if batch_size is None else (batch_size, layer.num_heads)
            self[i] = torch.ones(shape, dtype=torch.float32, device=self[i].device, requires_grad=requires_grad)


def gated_features(x: torch.Tensor, gate: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The output projection's input features x [..., heads * head_dim] with each head's multiplied by its
    gate ([heads], or [batch, heads] per example)."""
    gate = gate.to(x.device, x.dtype)  # offloaded layers (device_map) run where accelerate puts them
    heads = x.reshape(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)
    if gate.dim() == 2:  # [batch, heads] against [batch, ..., heads, head_dim]
        gate = gate.reshape(gate.shape[0], *([1] * (heads.dim() - 3)), gate.shape[1])
    return (heads * gate.unsqueeze(-1)).reshape(x.shape)


def gate_hook(gates: list[torch.Tensor], i: int, head_dim: int):
    """A forward pre-hook for an output projection that multiplies each head's features by `gates[i]`."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        return (gated_features(x, gates[i], head_dim), *rest)

    return hook


@contextmanager
def head_gates(model: nn.Module, requires_grad: bool = True) -> Iterator[HeadGates]:
    """Attach a gate to every head of every attention layer for the duration of the block.

    Gates are forward pre-hooks on each layer's output projection (the module that consumes the
    concatenated heads), so they work with eager, sdpa and flash attention. All ones gives the plain
    model's outputs; a zero gives the outputs of the model with that head removed; d(loss)/d(gate) is the
    head importance of Michel et al. (2019). The hooks are removed on exit.
    """
    layers = find_attention(model)
    tensors = []
    for layer in layers:
        device = resolve(layer.module, layer.spec.o).weight.device
        device = torch.device("cpu") if device.type == "meta" else device  # offloaded weights (device_map)
        tensors.append(torch.ones(layer.num_heads, dtype=torch.float32, device=device, requires_grad=requires_grad))
    gates = HeadGates(layers, tensors)
    with hooks(
        (resolve(layer.module, layer.spec.o), "forward_pre", gate_hook(gates, i, layer.head_dim))
        for i, layer in enumerate(layers)
    ):
        yield gates


def fold_gates(layer: AttentionLayer, scales: torch.Tensor) -> None:
    """Multiply each kept head's output-projection columns by its gate value, in place (exact: the gates act
    linearly there), so the model computes without hooks what the gated model computed."""
    output_projection(layer).scale_inputs(scales.repeat_interleave(layer.head_dim))
