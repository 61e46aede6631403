import logging

import pytest
import tiny_models as tm
import torch
from torch import nn

import prune_heads as ph
from prune_heads import scan_attention
from prune_heads.model.layers import require_attention


def test_find_attention_describes_each_layer():
    layers = ph.find_attention(tm.build("whisper"))
    assert [layer.index for layer in layers] == list(range(6))
    assert [layer.kind for layer in layers] == ["self", "self", "self", "cross", "self", "cross"]
    first = layers[0]
    assert (first.num_heads, first.num_kv_heads, first.head_dim, first.heads) == (4, 4, 8, (0, 1, 2, 3))
    assert first.spec.name == "bart" and first.name == "model.encoder.layers.0.self_attn"


def test_grouped_layers_report_kv_heads():
    layer = ph.find_attention(tm.build("qwen2"))[0]
    assert (layer.num_heads, layer.num_kv_heads, layer.group_size, layer.kv_heads) == (4, 2, 2, (0, 1))


class RenamedLlamaAttention(nn.Module):
    """An unregistered class with the standard llama projection names."""

    def __init__(self, inner):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = inner.q_proj, inner.k_proj, inner.v_proj, inner.o_proj
        self.head_dim, self.num_key_value_groups, self.inner = inner.head_dim, inner.num_key_value_groups, inner

    def forward(self, *args, **kwargs):
        self.inner.num_key_value_groups = self.num_key_value_groups
        return self.inner(*args, **kwargs)


def test_unregistered_modules_with_standard_names_are_found_structurally():
    model, inputs = tm.build("llama"), tm.make_inputs("llama")
    for layer in model.model.layers:
        layer.self_attn = RenamedLlamaAttention(layer.self_attn)
    layers = ph.find_attention(model)
    assert len(layers) == 3 and layers[0].spec.name == "llama"
    ph.prune(model, {0: [0, 1]})
    assert model(**inputs).logits.shape == (2, 7, 128)


class OddAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wkv, self.wout = nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(8, 8)


def test_unknown_attention_modules_are_named_in_the_error():
    model = nn.Sequential(OddAttention())
    with pytest.raises(ph.UnsupportedModelError, match=r"0 \(OddAttention\).*register_family"):
        ph.find_attention(model)


def test_registering_a_family_makes_it_prunable():
    class TinyAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(8, 8) for _ in range(4))
            self.n_heads, self.dim_per_head = 4, 2

        def forward(self, x):
            q, k, v = (f(x).unflatten(-1, (self.n_heads, 2)).transpose(1, 2) for f in (self.wq, self.wk, self.wv))
            return self.wo(torch.softmax(q @ k.transpose(-1, -2), -1).matmul(v).transpose(1, 2).flatten(2))

    ph.register_family(
        ph.AttentionSpec(
            "tiny",
            ("TinyAttention",),
            q="wq",
            k="wk",
            v="wv",
            o="wo",
            head_dim="dim_per_head",
            updates=(("", "n_heads", "heads"),),
        )
    )
    try:
        model = nn.Sequential(TinyAttention())
        x = torch.randn(2, 3, 8)
        with ph.head_gates(model) as gates, torch.no_grad():
            gates[0][1] = 0
            gated = model(x)
        ph.prune(model, {0: [1]})
        assert model[0].n_heads == 3
        torch.testing.assert_close(model(x), gated, rtol=0, atol=1e-6)
    finally:
        ph.FAMILIES.pop(0)


class PoolingAttention(nn.Module):
    """Attention of no registered family (torch's MultiheadAttention inside), as in SigLIP's pooling head."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)


def test_unsupported_attention_beside_supported_layers_is_left_alone(caplog):
    model = tm.build("llama")
    model.model.pool = PoolingAttention()
    layers, unsupported = scan_attention(model)
    assert len(layers) == 3
    assert [(u.name, u.class_name, u.why) for u in unsupported] == [
        ("model.pool", "PoolingAttention", "an attention module of no registered family")
    ]
    with caplog.at_level(logging.WARNING, logger="prune_heads"):
        assert len(require_attention(model)) == 3
    assert (
        "1 attention module(s) of the model are left as they are (model.pool (PoolingAttention): an "
        "attention module of no registered family); the other 3 layers are pruned" in caplog.text
    )
    ph.prune(model, {0: [0, 1]})
    assert ph.find_attention(model)[0].num_heads == 2
    with pytest.raises(
        ph.UnsupportedModelError,
        match=r"^0 \(PoolingAttention\): an attention module of no "
        r"registered family; register it with",
    ):
        ph.find_attention(nn.Sequential(PoolingAttention()))


def test_gemma3_with_its_siglip_pooling_head_prunes_everything_else():
    """The issue's example: one vision-tower MultiheadAttention used to refuse the whole model."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        num_hidden_layers=2,
        vocab_size=300,
    )
    vision = dict(
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        num_hidden_layers=2,
        image_size=32,
        patch_size=8,
        vision_use_head=True,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(
        Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    ).eval()
    layers, unsupported = scan_attention(model)
    assert [u.class_name for u in unsupported] == ["SiglipMultiheadAttentionPoolingHead"]
    assert [l.spec.name for l in layers] == ["opt", "opt", "llama", "llama"]
    ids = torch.randint(5, 250, (2, 8))
    with ph.head_gates(model) as gates, torch.no_grad():
        gates[3][:2] = 0.0
        expected = model(input_ids=ids).logits
    ph.prune(model, {3: [0, 1]})
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=1e-5)


def _zamba(layers: int | None = None):
    import transformers

    sizes = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_head_dim=8,
        intermediate_size=64,
        vocab_size=128,
        mamba_d_state=4,
        mamba_dt_rank=4,
    )
    config = transformers.ZambaConfig(**sizes, **({"num_hidden_layers": layers} if layers else {}))
    torch.manual_seed(0)
    return transformers.ZambaForCausalLM(config).eval()


def test_attention_layers_with_tied_weights_are_refused_with_the_layers_they_share_with():
    # Zamba's shared transformer block serves several depths through modules of its own that hold the same
    # parameters: cutting one would untie them, and a reload would tie them again to other weights
    model = _zamba()
    layers, unsupported = scan_attention(model)
    assert not layers and len(unsupported) == 13
    assert all("tied to" in u.why for u in unsupported) and not any(u.registrable for u in unsupported)
    with pytest.raises(
        ph.UnsupportedModelError,
        match=r"tied to model\.layers\.\d+\.shared_transf\.self_attn and "
        r"11 more.*no attention layer of this model can lose heads",
    ):
        ph.find_attention(model)


def test_a_tie_between_two_layers_leaves_them_and_prunes_the_others(caplog):
    llama = tm.build("llama")  # 3 layers
    first, second = (llama.model.layers[i].self_attn for i in (1, 2))
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(second, name).weight = getattr(first, name).weight
    layers, unsupported = scan_attention(llama)
    assert [l.name for l in layers] == ["model.layers.0.self_attn"]
    assert {u.name: u.why.split(":")[0] for u in unsupported} == {
        "model.layers.1.self_attn": "its weights are tied to model.layers.2.self_attn",
        "model.layers.2.self_attn": "its weights are tied to model.layers.1.self_attn",
    }
    before = sum(p.numel() for p in llama.parameters())
    ph.prune(llama, {"model.layers.0.self_attn": [0, 1]})
    assert sum(p.numel() for p in llama.parameters()) < before and second.q_proj.weight is first.q_proj.weight


def test_a_module_reused_at_every_depth_is_not_tied_to_itself():
    albert = tm.build("albert")  # one layer object called at every depth
    assert len(ph.find_attention(albert)) == 1 and not scan_attention(albert)[1]


def test_attention_that_keeps_its_heads_in_parameter_tensors_is_named_not_missed():
    import transformers

    xlnet = transformers.XLNetLMHeadModel(
        transformers.XLNetConfig(d_model=32, n_head=4, n_layer=2, d_inner=64, vocab_size=128)
    )
    with pytest.raises(
        ph.UnsupportedModelError,
        match=r"rel_attn \(XLNetRelativeAttention\).*its heads live in its "
        r"own parameter tensors q, k, v, o, r",
    ):
        ph.find_attention(xlnet)


@pytest.mark.slow
def test_saving_a_model_with_tied_blocks_keeps_them_tied(tmp_path):
    model = _zamba(num_layers := 12)
    inputs = {"input_ids": torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))}
    ph.save_pruned(model, tmp_path / "m")
    loaded = ph.load_pruned(tmp_path / "m").eval()
    assert num_layers and sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=1e-5)


def test_cutting_a_full_attention_layer_calibrated_inside_the_sliding_window_is_noted():
    """A Gemma 3 with a full-attention layer among sliding ones (window 4): a plan that cuts the full layer,
    calibrated on sequences no longer than the window, gets a note naming it; longer sequences, a plan of
    sliding layers only, or a model without windows get none."""
    from transformers import Gemma3ForCausalLM

    from prune_heads.model.layers import unmeasured_long_range

    config = tm.build("gemma3").config
    config.layer_types = ["sliding_attention", "sliding_attention", "full_attention"]
    layers = ph.find_attention(Gemma3ForCausalLM(config))
    full, sliding = layers[2].name, layers[0].name
    note = unmeasured_long_range(layers, {full: [0, 1], sliding: [0, 1]}, 4)
    assert note is not None and f"1 full-attention layers lose heads ({full})" in note and "(4 tokens)" in note
    assert unmeasured_long_range(layers, {full: [0, 1]}, 5) is None
    assert unmeasured_long_range(layers, {sliding: [0, 1]}, 4) is None
    llama = ph.find_attention(tm.build("llama"))
    assert unmeasured_long_range(llama, {llama[0].name: [0, 1]}, 4) is None


def test_a_family_name_registered_already_is_refused():
    spec = next(s for s in ph.FAMILIES if s.name)
    with pytest.raises(ValueError, match=f"'{spec.name}' is registered already"):
        ph.register_family(spec)
