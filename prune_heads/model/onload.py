"""Models larger than the accelerator: their weights in CPU memory and each offloaded module moved to the
accelerator for its own forward pass only (sequential onloading, as llm-compressor calibrates models larger
than one GPU). A model that accelerate loaded with CPU offload (`device_map="auto"` with `max_memory`) keeps
its offloaded weights on the meta device, where surgery cannot cut them; `onload_offloaded` makes them
ordinary CPU tensors and runs each offloaded module on accelerate's execution device, moving its weights there
for the call and dropping them after. In a pass with gradients the module's weights are moved again for its
backward (activation checkpointing) instead of kept, so beyond what lives on the device only the module being
run holds weights there. A pass without gradients can run layer-major instead (`passes`): every batch through
one block before the next, each block's weights moved once (`held`); `moved_bytes` counts what was moved."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call swaps weights with
from torch.utils.checkpoint import checkpoint

from ..errors import PruneHeadsError
from ..runtime.memory import weight_bytes
from .blocks import Resume, block_chain
from .layers import find_attention

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


def onloaded(model: nn.Module) -> list[_Onloaded]:
    """The onloaded modules' forwards (`onload_offloaded`'s), in the model's order."""
    found = [m.__dict__.get("forward") for m in model.modules()]
    return [f for f in found if isinstance(f, _Onloaded)]


def moved_bytes(model: nn.Module) -> int:
    """The bytes onloading has moved to the execution device so far (0 where nothing is onloaded; a move to the
    device the weights are on counts too, so a CPU run counts what a GPU's would)."""
    return sum(f.moved for f in onloaded(model))


def offloaded_bytes(model: nn.Module) -> int:
    """The bytes of the onloaded modules' weights (what one layer-major pass moves)."""
    return sum(weight_bytes(f.module) for f in onloaded(model))


@contextmanager
def held(modules: list[nn.Module]) -> Iterator[None]:
    """The onloaded modules among `modules` and their submodules keep their weights on the device, moved once,
    until the block ends (a layer-major sweep runs every batch through them in turn)."""
    with ExitStack() as stack:
        for forward in {id(f): f for m in modules for f in onloaded(m)}.values():
            stack.enter_context(forward.held())
        yield


_CHAINS: WeakKeyDictionary[nn.Module, nn.ModuleList | None] = WeakKeyDictionary()  # `prove_layer_major`'s


def prove_layer_major(model: nn.Module, batch: dict) -> bool:
    """Whether passes without gradients run layer-major on this onloaded model from now on (`passes`): its
    onloaded blocks lie in one chain that no onloaded module holds whole, and on `batch` a layer-major pass
    gives the model's outputs bit for bit (call it outside any hooks; False where nothing is onloaded)."""
    found = block_chain(model, find_attention(model)) if onloaded(model) else None
    chain = found[0] if found is not None else None
    if chain is not None and any(chain in list(f.module.modules()) for f in onloaded(model)):
        chain = None  # moved whole with the module that holds it: nothing to gain
    if chain is not None:
        resume = Resume(chain, [batch], lambda b: model(**b), held)

        def resumed() -> torch.Tensor:
            with resume.resumed():
                return _tensors(model(**batch))

        chain = chain if resume.proven(lambda: _tensors(model(**batch)), resumed) else None
    _CHAINS[model] = chain
    return chain is not None


def layer_major_chain(model: nn.Module) -> nn.ModuleList | None:
    """The chain of blocks `prove_layer_major` proved on this model, or None."""
    return _CHAINS.get(model)


def passes(model: nn.Module, batches: list[dict], run: Callable[[dict], Any]) -> Iterable[Any]:
    """`run(batch)` for each batch in turn, in a pass without gradients: layer-major where
    `prove_layer_major` proved it on `model` (every batch through one block before the next, each onloaded
    module's weights moved once), else batch by batch."""
    chain = _CHAINS.get(model)
    if chain is None or torch.is_grad_enabled():
        return map(run, batches)
    return _layer_major(model, chain, batches, run)


def _layer_major(model: nn.Module, chain: nn.ModuleList, batches: list[dict], run: Callable) -> Iterator[Any]:
    inner = {id(f) for f in onloaded(chain)}
    outside = [f.module for f in onloaded(model) if id(f) not in inner]
    resume = Resume(chain, batches, run, held)
    with held(outside), resume.resumed():
        for batch in batches:
            yield run(batch)


def _tensors(output: Any) -> torch.Tensor:
    """Every tensor of a model's output, flat (float64 holds each value exactly), to compare bit for bit."""
    values = output.to_tuple() if hasattr(output, "to_tuple") else output if isinstance(output, tuple) else (output,)
    return torch.cat([v.detach().flatten().double() for v in values if torch.is_tensor(v)])


class _Onloaded:
    """A module's forward run with its weights moved to `device` for the call (or once, while `held`); with
    gradients, moved again for the backward instead of kept (no KV cache then: the recomputation would fill it
    twice, and a pass with gradients discards it). `moved` counts the bytes moved. An object, not a closure, so
    that a deep copy of the module runs its own weights."""

    def __init__(self, module: nn.Module, forward: Callable[..., Any], device: torch.device) -> None:
        bound = getattr(forward, "__self__", None) is module
        self.module, self.device = module, device
        self.forward = getattr(forward, "__func__", forward) if bound else forward
        self.bound = bound
        self.moved = 0
        self.kept: dict[str, torch.Tensor] | None = None

    @contextmanager
    def held(self) -> Iterator[None]:
        self.kept = self._moved()
        try:
            yield
        finally:
            self.kept = None

    def _moved(self) -> dict[str, torch.Tensor]:
        module = self.module
        self.moved += weight_bytes(module)
        return {name: t.to(self.device) for name, t in [*module.named_parameters(), *module.named_buffers()]}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._run(*args, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in _CACHE_ARGUMENTS}
        return checkpoint(self._run, *args, use_reentrant=False, **kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        from accelerate.utils import send_to_device

        module = self.module
        weights = self.kept if self.kept is not None else self._moved()
        args, kwargs = send_to_device(args, self.device), send_to_device(kwargs, self.device)  # as accelerate did
        with _reparametrize_module(module, weights):
            return self.forward(module, *args, **kwargs) if self.bound else self.forward(*args, **kwargs)
