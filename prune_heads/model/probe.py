"""`prune`, proven before it changes anything: every planned layer is first pruned on a copy and run.

The family table says where each module keeps its heads, but a module can keep per-head state the table does
not know (a relative position table, an attention sink per head, a head count read from another attribute).
So before the real surgery, each planned layer is copied, its heads are removed on the copy, and the copy is
called on the arguments the layer received in a forward pass of the model (random inputs, or the caller's):
its output must equal the original layer's with those heads' gates at zero. A layer that crashes or differs
is refused with PlanError and the model is left untouched.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from ..model.inputs import dummy_inputs
from ..runtime.devices import input_device, to_device
from .families import spec_for_type
from .gates import gate_hook
from .hooks import hooks
from .layers import AttentionLayer, describe, find_attention, resolve
from .surgery import Plan, PlanError, apply_plan, normalize_plan, prepare, remove_heads, write_record

TOLERANCE = 1e-4  # relative to the largest output value: float32 reordering, never a removed head's effect


CALLS = 3  # calls of one layer proven: a module reached from several places is proven on more than its first


def capture_calls(model: nn.Module, layers: list[AttentionLayer], inputs: dict | None) -> tuple[dict, str | None]:
    """The (args, kwargs) of each layer module's first CALLS calls in one forward pass (a module used at
    several depths is called with other inputs each time); and why the pass failed, if it did."""
    calls: dict[str, list[tuple]] = {}

    def hook_for(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if len(calls.setdefault(name, [])) < CALLS:  # copied now: the call would update a cache inside them
                calls[name].append(copy.deepcopy((args, kwargs)))

        return hook

    error = None
    # prepended: the arguments as the layer's own pre-hooks (a family's head selection) will receive them
    with hooks(
        ((layer.module, "forward_pre", hook_for(layer.name)) for layer in layers), with_kwargs=True, prepend=True
    ):
        try:
            if inputs is None:
                inputs = to_device(dummy_inputs(model, batch_size=2, seq_len=8), input_device(model))
            inputs = _small(inputs)
            if "use_cache" in inspect.signature(model.forward).parameters:
                inputs = {**inputs, "use_cache": False}  # a cache the pass fills would grow under the copies
            with torch.no_grad():
                model(**inputs)
        except Exception as failure:  # the model's own code (or a model dummy_inputs cannot feed): anything
            error = reason(failure)
    return calls, error


def reason(failure: BaseException) -> str:
    lines = str(failure).strip().splitlines()
    return f"{type(failure).__name__}: {lines[0]}" if lines else type(failure).__name__


def _small(inputs: dict, rows: int = 2, tokens: int = 32) -> dict:
    """The batch cut to its first `rows` examples when every tensor in it has the same first dimension (else
    as it is: flattened image patches do not split by example), and to its first `tokens` positions when it
    is text (input_ids, and every tensor [batch, tokens]): the captured arguments of every layer stay small."""
    tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    if len({v.shape[0] for v in tensors}) != 1:
        return inputs
    text = "input_ids" in inputs and all(v.dim() == 2 for v in tensors) and len({v.shape[1] for v in tensors}) == 1
    return {
        k: (v[:rows, :tokens] if text else v[:rows]) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
        for k, v in inputs.items()
    }


def first_tensor(output: Any) -> torch.Tensor | None:
    return next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor)), None)


def _shared_norm(layer: AttentionLayer) -> str | None:
    """Why the layer cannot be exact when it normalises q or k over all heads together (OLMo2, OLMoE)."""
    width = layer.num_heads * layer.head_dim
    for name, child in layer.module.named_children():
        weight = getattr(child, "weight", None)
        if (
            re.fullmatch(r"(q|k|query|key)_?(layer_?)?norm", name)
            and isinstance(weight, torch.Tensor)
            and layer.num_heads > 1
            and weight.numel() in (width, layer.num_kv_heads * layer.head_dim)
            and weight.numel() != layer.head_dim
        ):
            return (
                f"its {name} normalises over all heads together, so removing a head changes the others "
                f"(no removal can be exact)"
            )
    return None


def _half(module: nn.Module) -> bool:
    """Whether the layer is in half precision: its removal is then proven in float32, on the structure, not on
    rounding (one unit in the last place of bfloat16 is 0.8%, far over TOLERANCE)."""
    return any(p.dtype in (torch.float16, torch.bfloat16) for p in module.parameters())


def _to_float32(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def float32_copy(layer: AttentionLayer, call: tuple) -> tuple[nn.Module, tuple, dict]:
    """A copy of the layer's module and of one captured call (args, kwargs), both in float32 where the layer is
    in half precision (see `_half`)."""
    half = _half(layer.module)
    args, kwargs = tree_map(_to_float32, call) if half else call
    module = copy.deepcopy(layer.module)
    return (module.float() if half else module), copy.deepcopy(args), copy.deepcopy(kwargs)


def mismatch(expected: torch.Tensor | None, got: torch.Tensor | None) -> str | None:
    """Why a changed layer's output is not the reference's (None: equal within TOLERANCE of its largest value)."""
    if expected is None or got is None or got.shape != expected.shape:
        return "its output changes shape"
    expected, got = expected.float(), got.float()
    both_nan = expected.isnan() & got.isnan()  # fully masked rows (padding cut short) give NaN either way
    scale = expected.nan_to_num().abs().max().item() or 1.0
    error = (got - expected).abs().masked_fill(both_nan, 0).max().item()
    if not error <= TOLERANCE * scale:
        return f"its output differs from the gated layer's by {error:.3g} (of {scale:.3g})"
    return None


def _differs(layer: AttentionLayer, heads: list[int], call: tuple) -> str | None:
    """Why removing `heads` from a copy of the layer does not give the gated layer's output (None: it does)."""
    shared = _shared_norm(layer)
    if shared is not None:
        return shared
    kept = torch.tensor([0.0 if h in heads else 1.0 for h in layer.heads])
    reference, args, kwargs = float32_copy(layer, call)
    o_proj = resolve(reference, layer.spec.o)
    try:
        with (
            torch.no_grad(),
            hooks([(o_proj, "forward_pre", gate_hook([kept.to(o_proj.weight.device)], 0, layer.head_dim))]),
        ):
            expected = first_tensor(reference(*args, **kwargs))
    except Exception as failure:  # the module's own forward, with gates
        return f"it fails with gates on its inputs ({reason(failure)})"
    pruned, args, kwargs = float32_copy(layer, call)
    try:
        after = remove_heads(describe(pruned, layer.spec, layer.name, layer.index), heads)
        with torch.no_grad():
            got = first_tensor(pruned(*args, **kwargs))
    except Exception as failure:  # the module's own forward after slicing
        return f"it fails after the removal ({reason(failure)})"
    if after.num_heads != layer.num_heads - len(heads):
        return f"it reports {after.num_heads} heads after removing {len(heads)} of {layer.num_heads}"
    return mismatch(expected, got)


def probe_plan(
    model: nn.Module, layers: list[AttentionLayer], plan: dict[str, list[int]], inputs: dict | None = None
) -> None:
    """Prove a normalized plan exact on copies of its layers before any surgery (see the module docstring).

    `inputs` is one batch for the model (default: random inputs of the right shape). A layer of a registered
    class that the pass never reaches is trusted to the table, whose families are tested; one matched only by
    its structure must be proven. Raises PlanError naming the layer and the register_family fix. The
    families' one-time preparation runs first (it changes no output: T5 layers get their own copy of the
    shared relative bias table), so the layers are captured as the surgery will see them; a refused plan
    undoes it, leaving parameters, buffers, hooks and outputs exactly as they were.
    """
    planned = [layer for layer in layers if plan.get(layer.name)]
    if not planned:
        return
    with restored_on_error(model):
        prepare(model, layers, plan)  # families whose layers share per-head state get their own first
        _prove(model, planned, plan, inputs)


@contextmanager
def restored_on_error(model: nn.Module) -> Iterator[None]:
    """Put every module's attributes, children, parameters, buffers and hooks back as they were if the block
    raises (a shallow restore: what a family's preparation adds, a bias table or a hook, goes again)."""
    saved = [
        (module, {k: copy.copy(v) if isinstance(v, dict) else v for k, v in vars(module).items()})
        for module in model.modules()
    ]
    try:
        yield
    except BaseException:
        for module, state in saved:
            vars(module).clear()
            vars(module).update(state)
        raise


def _prove(model: nn.Module, planned: list[AttentionLayer], plan: dict[str, list[int]], inputs: dict | None) -> None:
    """Raise PlanError for the first planned layer whose removal is not exact on a copy."""
    calls, failure = capture_calls(model, planned, inputs)
    for layer in planned:
        by_table = spec_for_type(type(layer.module).__name__) is layer.spec
        why: str | None = None
        if layer.name not in calls:
            if by_table:
                continue
            why = f"a forward pass on random inputs did not reach it ({failure or 'the layer was not called'})"
        for use, call in enumerate(calls.get(layer.name, [])):
            why = _differs(layer, plan[layer.name], call)
            if why is not None and use:
                why = f"in its call number {use + 1} of the forward pass, {why}"
            if why is not None:
                break
        if why is not None:
            raise PlanError(
                f"cannot remove heads from {layer.name} ({type(layer.module).__name__}, handled as "
                f"'{layer.spec.name}' by {'the family table' if by_table else 'its structure'}): "
                f"{why}; nothing was changed. If its heads live elsewhere too, describe them with "
                f"prune_heads.register_family(AttentionSpec(...))"
            )


def probe_layers(model: nn.Module, layers: list[AttentionLayer], inputs: dict | None = None) -> None:
    """Prove that every layer can lose heads, before any scoring: one KV group (one head where the layer
    has one group) is removed from each layer with more than one head, on copies. Raises PlanError naming
    the first layer that cannot, so a run fails in seconds rather than after scoring."""
    plan = {}
    for layer in layers:
        if layer.num_heads > 1:
            first_group = [h for h in layer.heads if h // layer.group_size == layer.kv_heads[0]]
            plan[layer.name] = first_group if len(layer.kv_heads) > 1 else first_group[:1]
    probe_plan(model, layers, plan, inputs)


def prune(model: nn.Module, heads_to_prune: Plan, inputs: dict | None = None) -> nn.Module:
    """Physically remove attention heads from `model`, in place, and return it.

    `heads_to_prune` maps a layer (index into `find_attention(model)` or its module name) to the ORIGINAL
    indices of the heads to remove, as transformers 4's `prune_heads` took them. Pruning twice accumulates.
    Each planned layer is first proven exact on a copy (`probe_plan`, on `inputs` or random inputs). The
    removed heads are recorded in `model.config` so that `save_pruned` / `load_pruned` round-trip.
    Raises PlanError for a plan that cannot be applied, before anything changes.
    """
    layers = find_attention(model)
    plan = normalize_plan(layers, heads_to_prune)
    probe_plan(model, layers, plan, inputs)
    remove_proven(model, layers, plan)
    return model


def remove_proven(model: nn.Module, layers: list[AttentionLayer], plan: dict[str, list[int]]) -> None:
    """Remove a normalized plan that `probe_plan` accepted for these layers, and record it in the config."""
    apply_plan(model, layers, plan)
    if plan:
        write_record(model, layers)
