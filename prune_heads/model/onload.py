"""Models larger than the accelerator: their weights in CPU memory and each offloaded module moved to the
accelerator for its own forward pass only (sequential onloading, as llm-compressor calibrates models larger
than one GPU). A model that accelerate loaded with CPU offload (`device_map="auto"` with `max_memory`) keeps
its offloaded weights on the meta device, where surgery cannot cut them; `onload_offloaded` makes them
ordinary CPU tensors and runs each offloaded module on accelerate's execution device, moving its weights there
for the call and dropping them after. In a pass with gradients the module's weights are moved again for its
backward (activation checkpointing) instead of kept, so beyond what lives on the device only the module being
run holds weights there."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call swaps weights with
from torch.utils.checkpoint import checkpoint

from ..errors import PruneHeadsError
from ..runtime.memory import weight_bytes

_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


class OffloadError(PruneHeadsError, ValueError):
    """Weights offloaded where onloading cannot take them from (disk); the message names max_memory."""


def offload_hooks(model: nn.Module) -> list[tuple[str, nn.Module, Any]]:
    """(name, module, accelerate hook) of every module whose weights accelerate offloads between calls."""
    found = []
    for name, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        for one in getattr(hook, "hooks", [hook]):  # a SequentialHook holds several
            if getattr(one, "offload", False):
                found.append((name, module, one))
    return found


def check_offload(model: nn.Module) -> None:
    """Refuse, before any data is read, weights that accelerate offloaded to disk: onloading takes each module
    from CPU memory, so they must fit there (the message says how much)."""
    device_map = getattr(model, "hf_device_map", None) or {}
    on_disk = [name for name, where in device_map.items() if where == "disk"]
    if not on_disk:
        return
    modules = dict(model.named_modules())
    size = sum(weight_bytes(modules[name]) for name in on_disk if name in modules)
    raise OffloadError(
        f"{len(on_disk)} modules ({on_disk[0]}{', ...' if len(on_disk) > 1 else ''}) are offloaded to disk; "
        f"pruning onloads each module from CPU memory: load the model with max_memory giving the CPU "
        f"{size / 2**30:.1f} GiB more (max_memory={{0: ..., 'cpu': ...}}), or on a machine with that memory"
    )


def onload_offloaded(model: nn.Module) -> torch.device | None:
    """Turn accelerate's CPU offload into onloading (see the module's docstring), in place: returns the
    execution device, or None when nothing was offloaded. Outputs do not change."""
    check_offload(model)
    hooked = offload_hooks(model)
    if not hooked:
        return None
    from accelerate.hooks import remove_hook_from_module
    from accelerate.utils import set_module_tensor_to_device

    for _, module, hook in hooked:
        for name, _ in _managed(module, hook):
            set_module_tensor_to_device(module, name, "cpu", value=hook.weights_map[name])
        remove_hook_from_module(module)  # the hooks of modules kept on the device stay: they place inputs
        module.forward = _Onloaded(module, module.forward, torch.device(hook.execution_device))
    return torch.device(hooked[0][2].execution_device)


def _managed(module: nn.Module, hook: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors an offload hook moves: the module's parameters (its submodules' too where the hook places
    them) and, with offload_buffers, its buffers."""
    recurse = getattr(hook, "place_submodules", False)
    tensors: list[tuple[str, torch.Tensor]] = list(module.named_parameters(recurse=recurse))
    if getattr(hook, "offload_buffers", False):
        tensors += list(module.named_buffers(recurse=recurse))
    return tensors


class _Onloaded:
    """A module's forward run with its weights moved to `device` for the call; with gradients, moved again for
    the backward instead of kept (no KV cache then: the recomputation would fill it twice, and a pass with
    gradients discards it). An object, not a closure, so that a deep copy of the module runs its own weights."""

    def __init__(self, module: nn.Module, forward: Callable[..., Any], device: torch.device) -> None:
        bound = getattr(forward, "__self__", None) is module
        self.module, self.device = module, device
        self.forward = getattr(forward, "__func__", forward) if bound else forward
        self.bound = bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._run(*args, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in _CACHE_ARGUMENTS}
        return checkpoint(self._run, *args, use_reentrant=False, **kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        from accelerate.utils import send_to_device

        module = self.module
        weights = {name: t.to(self.device) for name, t in [*module.named_parameters(), *module.named_buffers()]}
        args, kwargs = send_to_device(args, self.device), send_to_device(kwargs, self.device)  # as accelerate did
        with _reparametrize_module(module, weights):
            return self.forward(module, *args, **kwargs) if self.bound else self.forward(*args, **kwargs)
