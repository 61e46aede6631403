"""Tiny random-weight models of every supported family, built from configs (no hub), and the helpers the
test modules share."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
import transformers as T

COMMON = dict(
    hidden_size=32,
    num_attention_heads=4,
    intermediate_size=64,
    num_hidden_layers=3,
    vocab_size=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
SEQ2SEQ = dict(
    d_model=32,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_layers=2,
    decoder_layers=2,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    vocab_size=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=1,
)

OWN_SIZES = {"swin", "swinv2"}  # configs that state every size themselves (Swin's heads are per stage)
# name: (config class, overrides, model class, kind); kind picks the inputs (see make_inputs)
FAMILIES = {
    "bert": (T.BertConfig, {}, T.BertForSequenceClassification, "encoder"),
    "roberta": (T.RobertaConfig, {"max_position_embeddings": 64}, T.RobertaForSequenceClassification, "encoder"),
    "xlm-roberta": (T.XLMRobertaConfig, {"max_position_embeddings": 64}, T.XLMRobertaModel, "encoder"),
    "electra": (T.ElectraConfig, {"embedding_size": 16}, T.ElectraForSequenceClassification, "encoder"),
    "albert": (T.AlbertConfig, {"embedding_size": 16}, T.AlbertForSequenceClassification, "encoder"),
    "distilbert": (
        T.DistilBertConfig,
        {"dim": 32, "n_heads": 4, "hidden_dim": 64, "n_layers": 3},
        T.DistilBertForSequenceClassification,
        "encoder",
    ),
    "deberta-v2": (
        T.DebertaV2Config,
        {
            "relative_attention": True,
            "pos_att_type": ["p2c", "c2p"],
            "max_relative_positions": 16,
            "position_buckets": 8,
        },
        T.DebertaV2ForSequenceClassification,
        "encoder",
    ),
    "deberta-v3": (
        T.DebertaV2Config,
        {
            "relative_attention": True,
            "pos_att_type": ["p2c", "c2p"],
            "share_att_key": True,
            "position_buckets": 8,
            "norm_rel_ebd": "layer_norm",
        },
        T.DebertaV2Model,
        "encoder",
    ),
    "mpnet": (T.MPNetConfig, {"max_position_embeddings": 64}, T.MPNetForSequenceClassification, "encoder"),
    "modernbert": (
        T.ModernBertConfig,
        {"global_attn_every_n_layers": 2, "local_attention": 8, "cls_token_id": 1, "sep_token_id": 2},
        T.ModernBertForSequenceClassification,
        "encoder",
    ),
    "gpt2": (T.GPT2Config, {"n_embd": 32, "n_head": 4, "n_layer": 3, "n_positions": 64}, T.GPT2LMHeadModel, "decoder"),
    "opt": (
        T.OPTConfig,
        {"ffn_dim": 64, "word_embed_proj_dim": 32, "max_position_embeddings": 64},
        T.OPTForCausalLM,
        "decoder",
    ),
    "llama": (T.LlamaConfig, {"num_key_value_heads": 2}, T.LlamaForCausalLM, "decoder"),
    "mistral": (T.MistralConfig, {"num_key_value_heads": 2}, T.MistralForCausalLM, "decoder"),
    "qwen2": (T.Qwen2Config, {"num_key_value_heads": 2}, T.Qwen2ForCausalLM, "decoder"),
    "qwen3": (T.Qwen3Config, {"num_key_value_heads": 2, "head_dim": 8}, T.Qwen3ForCausalLM, "decoder"),
    "gemma2": (
        T.Gemma2Config,
        {"num_key_value_heads": 2, "head_dim": 8, "sliding_window": 4},
        T.Gemma2ForCausalLM,
        "decoder",
    ),
    "gemma3": (
        T.Gemma3TextConfig,
        {"num_key_value_heads": 2, "head_dim": 8, "sliding_window": 4},
        T.Gemma3ForCausalLM,
        "decoder",
    ),
    "phi": (T.PhiConfig, {"num_key_value_heads": 4}, T.PhiForCausalLM, "decoder"),
    "phi3": (T.Phi3Config, {"num_key_value_heads": 2}, T.Phi3ForCausalLM, "decoder"),
    "gpt-neox": (T.GPTNeoXConfig, {"max_position_embeddings": 64}, T.GPTNeoXForCausalLM, "decoder"),
    "bloom": (T.BloomConfig, {}, T.BloomForCausalLM, "decoder"),
    "falcon": (T.FalconConfig, {"new_decoder_architecture": True, "num_kv_heads": 2}, T.FalconForCausalLM, "decoder"),
    "qwen3-next": (
        T.Qwen3NextConfig,
        {
            "num_key_value_heads": 2,
            "head_dim": 8,
            "num_hidden_layers": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "mlp_only_layers": [0, 1, 2, 3],
        },
        T.Qwen3NextForCausalLM,
        "decoder",
    ),
    "gptj": (T.GPTJConfig, {"rotary_dim": 4, "n_positions": 64}, T.GPTJForCausalLM, "decoder"),
    "xglm": (T.XGLMConfig, {"ffn_dim": 64, "max_position_embeddings": 64}, T.XGLMForCausalLM, "decoder"),
    "stablelm": (T.StableLmConfig, {"num_key_value_heads": 2, "qk_layernorm": True}, T.StableLmForCausalLM, "decoder"),
    "gpt-bigcode": (T.GPTBigCodeConfig, {"n_positions": 64, "multi_query": True}, T.GPTBigCodeForCausalLM, "decoder"),
    "t5": (
        T.T5Config,
        {
            "d_model": 32,
            "d_kv": 8,
            "num_heads": 4,
            "d_ff": 64,
            "num_layers": 2,
            "num_decoder_layers": 2,
            "vocab_size": 128,
            "decoder_start_token_id": 0,
        },
        T.T5ForConditionalGeneration,
        "seq2seq",
    ),
    "umt5": (
        T.UMT5Config,
        {
            "d_model": 32,
            "d_kv": 8,
            "num_heads": 4,
            "d_ff": 64,
            "num_layers": 2,
            "num_decoder_layers": 2,
            "vocab_size": 128,
            "decoder_start_token_id": 0,
        },
        T.UMT5ForConditionalGeneration,
        "seq2seq",
    ),
    "longt5": (
        T.LongT5Config,
        {
            "d_model": 32,
            "d_kv": 8,
            "num_heads": 4,
            "d_ff": 64,
            "num_layers": 2,
            "num_decoder_layers": 2,
            "vocab_size": 128,
            "decoder_start_token_id": 0,
            "local_radius": 4,
        },
        T.LongT5ForConditionalGeneration,
        "seq2seq",
    ),
    "bart": (T.BartConfig, SEQ2SEQ, T.BartForConditionalGeneration, "seq2seq"),
    "whisper": (
        T.WhisperConfig,
        {
            **SEQ2SEQ,
            "num_mel_bins": 8,
            "max_source_positions": 16,
            "max_target_positions": 32,
            "suppress_tokens": None,
            "begin_suppress_tokens": None,
        },
        T.WhisperForConditionalGeneration,
        "speech",
    ),
    "swin": (
        T.SwinConfig,
        {"image_size": 16, "patch_size": 2, "embed_dim": 32, "depths": [1, 1], "num_heads": [4, 4], "window_size": 4},
        T.SwinForImageClassification,
        "image",
    ),
    "swinv2": (
        T.Swinv2Config,
        {"image_size": 16, "patch_size": 2, "embed_dim": 32, "depths": [1, 1], "num_heads": [4, 4], "window_size": 4},
        T.Swinv2ForImageClassification,
        "image",
    ),
    "vit": (T.ViTConfig, {"image_size": 16, "patch_size": 4, "num_channels": 3}, T.ViTForImageClassification, "image"),
}


# `prune-heads run fixture-minilm-sentiment` made quick for the tests (the CLI's end-to-end runs)
FAST = [
    "--set",
    "data.score_examples=400",  # of 1,000: the flow is the same, each pass over it 2.5 times shorter
    "--set",
    "data.eval_examples=300",
    "--set",
    "evaluation.speed.repeats=2",
    "--set",
    "evaluation.speed.batch_size=8",
    "--set",
    "evaluation.speed.seq_len=64",
    "--set",
    "recovery.epochs=1",  # tuning's epochs are tested in test_recovery.py; four here were half the run's time
]


def build(name: str, dtype: torch.dtype = torch.float32, seed: int = 0, attn: str = "eager"):
    """Build the tiny model of a family, in eval mode, with seeded random weights."""
    config_class, overrides, model_class, _ = FAMILIES[name]
    base = {} if FAMILIES[name][3] in ("seq2seq", "speech") or name in OWN_SIZES else COMMON
    config = config_class(**{**base, **overrides})
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = model_class(config).to(dtype).eval()
    return model


def sensitive(model):
    """`model` (a tiny classifier) with its classifier's weights scaled up: a random head's outputs barely move
    (held-out divergences near 1e-9, where another CPU's rounding can reorder candidates), so decisions on
    them are made far above float noise."""
    with torch.no_grad():
        model.classifier.weight.mul_(300)
    return model


def make_inputs(name: str, batch: int = 2, seq: int = 7, seed: int = 1) -> dict[str, torch.Tensor]:
    """Inputs for one forward pass of the family's tiny model (with padding on the encoder side)."""
    kind = FAMILIES[name][3]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, -2:] = 0
    if kind == "image":
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g)}
    if kind == "speech":
        return {"input_features": torch.randn(batch, 8, 32, generator=g), "decoder_input_ids": ids[:, :5]}
    if kind == "seq2seq":
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :5]}
    if kind == "decoder":
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0, :2] = 0  # left padding, as generation uses
    return {"input_ids": ids, "attention_mask": mask}


def main_output(outputs) -> torch.Tensor:
    """The tensor to compare: logits where the model has them, else the last hidden state."""
    return outputs.logits if getattr(outputs, "logits", None) is not None else outputs.last_hidden_state


# attention classes that must keep a head (no forward for an emptied layer: the probe refuses one)
CANNOT_EMPTY = {"BloomAttention", "UMT5Attention", "LongT5LocalAttention"}


def uneven_plan(layers) -> dict[int, list[int]]:
    """A different removal per layer: one layer loses every head, grouped layers lose whole KV groups or the
    same number of query heads from each group, plain layers lose a growing number of heads."""
    plan = {}
    for layer in layers:
        i, heads, size = layer.index, layer.num_heads, layer.group_size
        if i % 3 == 1:
            plan[i] = list(range(heads - (type(layer.module).__name__ in CANNOT_EMPTY)))
        elif size > 1 and i % 3 == 2:
            plan[i] = [g * size for g in range(layer.num_kv_heads)]
        elif size > 1:
            plan[i] = list(range(size))
        else:
            plan[i] = [(i + j) % heads for j in range(1 + i % (heads - 1))]
    return plan


def batches(name="bert", n=5, labels=True, batch=4):
    """`n` batches of the family's tiny inputs; an encoder's with alternating labels unless `labels` is False."""
    out = [make_inputs(name, batch=batch, seq=9, seed=s) for s in range(n)]
    if labels and FAMILIES[name][3] == "encoder":
        out = [dict(b, labels=torch.tensor([0, 1] * (batch // 2))) for b in out]
    return out


def make_scores(rows, group_sizes=None, heads=None, original=None):
    """`HeadScores` of the given per-layer rows (layers named layers.i.attn), for selection without a model."""
    import prune_heads as ph  # here: the standalone test imports this module where prune_heads is not installed

    names = [f"layers.{i}.attn" for i in range(len(rows))]
    return ph.HeadScores(
        method="test",
        num_examples=1,
        scores={n: torch.tensor(r, dtype=torch.float32) for n, r in zip(names, rows)},
        heads={
            n: tuple(heads[i] if heads and heads[i] else range(len(r))) for i, (n, r) in enumerate(zip(names, rows))
        },
        group_sizes={n: (group_sizes or [1] * len(rows))[i] for i, n in enumerate(names)},
        original_heads={n: (original[i] if original else len(r)) for i, (n, r) in enumerate(zip(names, rows))},
    )


def gate_off(gates, layers, plan):
    """Set the gates of the plan's heads ({layer index: heads}) to 0."""
    with torch.no_grad():
        for i, heads in plan.items():
            for h in heads:
                gates[i][layers[i].heads.index(h)] = 0.0


def snapshot(result, model) -> dict:
    """What a change of how `prune_model` is written must leave alone: the plan, every decision with its
    held-out values, the counted work, and each floating tensor's sum and absolute sum after pruning."""
    recovery = [{k: v for k, v in entry.items() if k != "seconds"} for entry in result.recovery]
    weights = {
        name: [float(t.double().sum()), float(t.double().abs().sum())]
        for name, t in model.state_dict().items()
        if t.is_floating_point()
    }
    plan = {name: sorted(heads) for name, heads in sorted(result.plan.items())}
    found = {
        "plan": plan,
        "asked": result.asked,
        "recovery": recovery,
        "heldout": result.heldout,
        "work": result.work.as_dict(),
        "weights": weights,
    }
    if result.sharing:  # the KV heads shared and the depths measured, where a run has them
        found["sharing"] = {name: {str(k): v for k, v in merges.items()} for name, merges in result.sharing.items()}
    if result.frontier:
        found["frontier"] = [dataclasses.asdict(depth) for depth in result.frontier]
    return found


def assert_close(found, saved, path="report"):
    """`found` equals `saved` (a JSON round trip of a snapshot): the same keys, strings and integers, floats
    within 1e-4 relative (another CPU may sum in another order)."""
    import pytest

    if isinstance(saved, dict):
        assert sorted(found) == sorted(saved), f"{path}: keys {sorted(found)} != {sorted(saved)}"
        for key in saved:
            assert_close(found[key], saved[key], f"{path}.{key}")
    elif isinstance(saved, list):
        assert len(found) == len(saved), f"{path}: {len(found)} items != {len(saved)}"
        for i, (a, b) in enumerate(zip(found, saved)):
            assert_close(a, b, f"{path}[{i}]")
    elif isinstance(saved, float) or isinstance(found, float):
        assert found == pytest.approx(saved, rel=1e-4, abs=1e-7), f"{path}: {found} != {saved}"
    else:
        assert found == saved, f"{path}: {found!r} != {saved!r}"


@torch.no_grad()
def plant_scaled_kv_heads(layer, scales: dict[int, torch.Tensor]) -> None:
    """Make each KV head j of `scales` a copy of KV head j - 1: its key rows that head's times `scales[j]` per
    rotary pair (i, i + head_dim / 2), its value rows that head's."""
    k, v, dim = layer.module.k_proj.weight, layer.module.v_proj.weight, layer.head_dim
    for j, scale in scales.items():
        rows = k[(j - 1) * dim : j * dim].double()
        first, second = rows[: dim // 2], rows[dim // 2 :]
        real, imag = scale.real[:, None], scale.imag[:, None]
        k[j * dim : (j + 1) * dim] = torch.cat([real * first - imag * second, imag * first + real * second]).float()
        v[j * dim : (j + 1) * dim] = v[(j - 1) * dim : j * dim]


def planted_llama():
    """The tiny Llama with KV head 1 of every layer a rotary-pair scale of KV head 0 (keys) and a copy of it
    (values): sharing either into the other changes nothing, removing either loses its query heads."""
    from prune_heads import find_attention  # here: see make_scores

    model = build("llama")
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():  # peaked attention and logits: decisions far above float noise
        model.lm_head.weight.mul_(30)
    for layer in find_attention(model):
        with torch.no_grad():
            layer.module.q_proj.weight.mul_(4)
            layer.module.k_proj.weight.mul_(4)
        scale = torch.complex(*torch.randn(2, layer.head_dim // 2, generator=generator)).to(torch.complex128)
        plant_scaled_kv_heads(layer, {1: scale})
    return model


@contextmanager
def random_state_kept() -> Iterator[None]:
    """Seed torch's, Python's and numpy's generators, then fail unless the code inside leaves each as it was."""
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(6)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    yield
    assert torch.equal(torch.get_rng_state(), states[0]), "torch's random state changed"
    assert random.getstate() == states[1], "Python's random state changed"
    assert np.array_equal(np.random.get_state()[1], states[2]), "numpy's random state changed"
