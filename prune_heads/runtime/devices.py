"""Where a model's inputs go and how batches get there."""

from __future__ import annotations

from typing import Any

import torch


def to_device(batch: dict, device: torch.device | str) -> dict:
    """The batch with its tensors moved to `device`."""
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def on_device_of(value: Any, batch: dict) -> Any:
    """A tensor (or tuple of tensors) moved to the device of the batch's tensors."""
    device = next(v.device for v in batch.values() if torch.is_tensor(v))
    return tuple(t.to(device) for t in value) if isinstance(value, tuple) else value.to(device)


def input_device(model: torch.nn.Module) -> torch.device:
    """Where the model's inputs go: the first device of a `device_map` that is not disk, else the device of
    its first parameter (the CPU for weights offloaded to the meta device)."""
    placed = [d for d in getattr(model, "hf_device_map", {}).values() if d != "disk"]
    if placed:
        return torch.device(f"cuda:{placed[0]}" if isinstance(placed[0], int) else placed[0])
    device = next(model.parameters()).device
    return torch.device("cpu") if device.type == "meta" else device


def native_bfloat16(device: torch.device | str = "cpu") -> bool:
    """Whether `device` multiplies bfloat16 natively: a CUDA GPU that supports it, or a CPU with AVX-512 BF16 or
    AMX tiles (elsewhere torch emulates it, slower than float32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's own probes of the instructions
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)
