"""Models larger than the accelerator: accelerate's CPU offload turned into onloading gives the plan and the
weights of the same model held whole (here the execution device is the CPU: the code path is the one a GPU
takes, the device moves are the identity)."""

import pytest
import tiny_models as tm
import torch
from accelerate import cpu_offload
from accelerate.hooks import attach_align_device_hook_on_blocks
from accelerate.utils import OffloadedWeightsLoader

import prune_heads as ph
from prune_heads.model.onload import (
    OffloadError,
    check_offload,
    moved_bytes,
    offload_hooks,
    offloaded_bytes,
    onload_offloaded,
    passes,
    prove_layer_major,
)
from prune_heads.scoring.objective import Objective
from prune_heads.scoring.recording import record


def offloaded(name: str, how: str = "blocks") -> torch.nn.Module:
    """The tiny model with its embeddings and every other block offloaded by accelerate (weights on meta): one
    hook per block, as `device_map="auto"` with `max_memory` places them, or one per module with weights, as
    `cpu_offload` does."""
    model = tm.build(name)
    names = ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(0, len(model.model.layers), 2)]
    cpu = torch.device("cpu")
    if how == "leaves":
        for module in (model.get_submodule(n) for n in names):
            cpu_offload(module, execution_device=cpu)
        return model
    state = {k: v for k, v in model.state_dict().items() if any(k.startswith(n + ".") for n in names)}
    attach_align_device_hook_on_blocks(
        model,
        execution_device={n: cpu for n in names},
        offload=dict.fromkeys(names, True),
        weights_map=OffloadedWeightsLoader(state_dict=state),
    )
    return model


@pytest.mark.parametrize("how", ["blocks", "leaves"])
def test_offloaded_weights_become_cpu_tensors_and_outputs_stay(how):
    model, inputs = offloaded("llama", how), tm.make_inputs("llama")
    assert offload_hooks(model) and any(p.device.type == "meta" for p in model.parameters())
    with torch.no_grad():
        before = model(**inputs).logits
    assert onload_offloaded(model) == torch.device("cpu")
    assert not offload_hooks(model) and all(p.device.type == "cpu" for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, before)
        assert torch.equal(tm.build("llama")(**inputs).logits, before)


def test_gradients_through_onloaded_blocks_are_the_plain_ones():
    plain, model, inputs = tm.build("llama"), offloaded("llama"), tm.make_inputs("llama")
    onload_offloaded(model)
    grads = []
    for m in (plain, model):
        with ph.head_gates(m) as gates:
            m(**inputs).logits.float().square().mean().backward()
            grads.append([g.grad.clone() for g in gates])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("how", ["blocks", "leaves"])
def test_the_default_path_on_an_offloaded_model_gives_the_plan_and_weights_of_the_whole_one(how):
    name = "llama"
    plain, model = tm.build(name), offloaded(name, how)
    config = ph.PruneConfig(selection=ph.SelectionConfig(num_heads=4))
    expected = ph.prune_model(plain, tm.batches(name, labels=False), config, progress=False)
    found = ph.prune_model(model, tm.batches(name, labels=False), config, progress=False)
    assert found.plan == expected.plan
    assert found.work.offloaded_bytes > 0 and found.work.moved_bytes > found.work.offloaded_bytes
    state = plain.state_dict()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    generated = model.generate(**tm.make_inputs(name), max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, plain.generate(**tm.make_inputs(name), max_new_tokens=3, do_sample=False))


@pytest.mark.parametrize("how", ["blocks", "leaves"])
def test_a_pass_without_gradients_runs_layer_major_and_moves_each_offloaded_weight_once(how):
    model, batches = offloaded("llama", how), tm.batches("llama", labels=False)
    onload_offloaded(model)
    with torch.no_grad():
        before = moved_bytes(model)
        plain = [model(**b).logits for b in batches]
        assert moved_bytes(model) - before == len(batches) * offloaded_bytes(model)  # batch by batch: a copy each
        assert prove_layer_major(model, batches[0])
        before = moved_bytes(model)
        swept = [out.logits for out in passes(model, batches, lambda b: model(**b))]
    assert moved_bytes(model) - before == offloaded_bytes(model) > 0
    assert all(torch.equal(a, b) for a, b in zip(swept, plain))
    assert prove_layer_major(model, batches[0]) and not prove_layer_major(tm.build("llama"), batches[0])


def test_recording_layer_major_gives_the_statistics_and_outputs_of_the_whole_model():
    plain, model, batches = tm.build("llama"), offloaded("llama"), tm.batches("llama", labels=False)
    onload_offloaded(model)
    assert prove_layer_major(model, batches[0])
    expected, found = (record(m, batches, Objective(m), gram=True) for m in (plain, model))
    assert found.calls == len(batches)
    pairs = [(a, b) for x, y in zip(expected.targets, found.targets) for a, b in zip(x, y)]  # compact targets
    assert len(pairs) >= len(batches) and all(torch.equal(a, b) for a, b in pairs)
    assert all(torch.equal(a.values, b.values) for a, b in zip(expected.moments, found.moments))


def test_weights_offloaded_to_disk_are_refused_naming_max_memory():
    model = tm.build("llama")
    model.hf_device_map = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "disk"}
    with pytest.raises(OffloadError, match=r"2 modules \(model.layers.0, ...\) are offloaded to disk.*max_memory"):
        check_offload(model)
