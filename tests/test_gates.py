import pytest
import tiny_models as tm
import torch

import prune_heads as ph


@pytest.mark.parametrize("name", list(tm.FAMILIES))
def test_gates_of_one_equal_the_plain_model(name):
    model, inputs = tm.build(name), tm.make_inputs(name)
    with torch.no_grad():
        plain = tm.main_output(model(**inputs))
        with ph.head_gates(model) as gates:
            gated = tm.main_output(model(**inputs))
        after = tm.main_output(model(**inputs))
    assert len(gates) == len(ph.find_attention(model))
    assert all(g.dtype == torch.float32 and g.requires_grad for g in gates)
    assert torch.equal(plain, gated)
    assert torch.equal(plain, after)  # hooks removed on exit


def test_gate_gradients_flow_for_every_head():
    model, inputs = tm.build("llama"), tm.make_inputs("llama")
    with ph.head_gates(model) as gates:
        model(**inputs).logits.float().pow(2).mean().backward()
    assert all(g.grad is not None and g.grad.shape == g.shape and g.grad.abs().sum() > 0 for g in gates)


def test_per_example_gates_match_single_example_runs():
    model, inputs = tm.build("bert"), tm.make_inputs("bert")
    with ph.head_gates(model) as gates:
        gates.reset(batch_size=2)
        with torch.no_grad():
            gates[0][1, 2] = 0.0
        both = model(**inputs).logits
        gates.reset()
        with torch.no_grad():
            gates[0][2] = 0.0
        second = model(**{k: v[1:] for k, v in inputs.items()}).logits
        gates.reset()
        first = model(**{k: v[:1] for k, v in inputs.items()}).logits
    torch.testing.assert_close(both[1:], second, rtol=0, atol=1e-6)
    torch.testing.assert_close(both[:1], first, rtol=0, atol=1e-6)


def test_gates_keep_model_dtype():
    model, inputs = tm.build("qwen2", dtype=torch.bfloat16), tm.make_inputs("qwen2")
    with ph.head_gates(model) as gates, torch.no_grad():
        out = model(**inputs).logits
    assert gates[0].dtype == torch.float32 and out.dtype == torch.bfloat16
