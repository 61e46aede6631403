"""The family table: where each transformers attention module keeps its heads.

A family is described by data (projection names, fused layouts, attributes to update, extra per-head
parameters), not by code paths. Register a new one with `register_family(AttentionSpec(...))`.

Copied as it is into standalone checkpoints (see standalone.py): it may import only torch and transformers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class AttentionSpec:
    """How one attention module lays out its heads.

    Paths are dotted attribute paths relative to the matched module (the anchor). `q`, `k`, `v` are the
    projections producing heads; or `fused_qkv` is one projection whose outputs are [q | k | v] with q of
    num_heads * head_dim and k, v of num_kv_heads * head_dim features (`fused_layout` "blocks"), or
    [q | k | v] of head 0, then of head 1, ... ("heads": GPT-NeoX, BLOOM), or per KV group the group's
    query heads then its k and v ("groups": Falcon's new architecture); a function of the module may pick.
    `q_blocks` is 2 where q's projection gives each head its query and then an output gate (Qwen3-Next).
    `o` consumes the concatenated heads. `head_dim` names the head size attribute, or is a function of the
    module for modules that keep none. `updates` lists (path, attribute, quantity) set after slicing,
    quantity one of "heads", "kv_heads", "inner" (heads * head_dim), "kv_groups" (query heads per KV head);
    a path that resolves to a model config gets a private view of it. `per_head_out` are further
    projections sliced like q, `per_head_columns` parameters with one column per head, `per_head_lists` and
    `per_kv_head_lists` ModuleLists with one module per query or KV head, `per_head_params` parameters whose
    first dimension is the query heads (an attention sink per head); each only where present. `prepare`
    runs once on the whole model before its first surgery, for families whose layers share per-head state.
    `no_heads` names the module whose forward is replaced when a layer loses every head (so no zero-width
    projection or reshape runs: some families' code cannot, and ONNX reshapes cannot), and
    `no_heads_outputs` the length of the tuple that module returns.
    """

    name: str
    module_types: tuple[str, ...]
    o: str
    head_dim: str | Callable[[Any], int]  # a function of the module (a transformers module: Any attributes)
    q: str | None = None
    k: str | None = None
    v: str | None = None
    fused_qkv: str | None = None
    fused_layout: str | Callable[[Any], str] = "blocks"
    q_blocks: int = 1
    grouped: bool = False
    updates: tuple[tuple[str, str, str], ...] = ()
    per_head_out: tuple[str, ...] = ()
    per_head_columns: tuple[str, ...] = ()
    per_head_lists: tuple[str, ...] = ()
    per_kv_head_lists: tuple[str, ...] = ()
    per_head_params: tuple[str, ...] = ()
    prepare: Callable[[nn.Module], None] | None = field(default=None, compare=False)
    no_heads: str | None = None
    no_heads_outputs: int = 2


_T5_SELF = ("SelfAttention", "LocalSelfAttention", "TransientGlobalSelfAttention")  # T5, LongT5


def _t5_attention(sub: Any) -> tuple[Any, bool]:
    """A T5 sub-layer's attention module and whether it is self-attention."""
    for name in _T5_SELF:
        if hasattr(sub, name):
            return getattr(sub, name), True
    return getattr(sub, "EncDecAttention", None), False


def _t5_own_position_bias(model: nn.Module) -> None:
    """Give every T5 / LongT5 attention layer its own relative position bias.

    T5 computes the bias in block 0 and hands the [1, heads, q, k] tensor to every later block, which breaks
    as soon as layers keep different heads. Each self-attention layer gets a copy of its stack's bias table
    (exact: same values) and computes the bias itself; cross-attention layers compute their zero bias. UMT5
    layers already compute their own and are left alone.
    """
    stack: Any
    for stack in model.modules():
        blocks = getattr(stack, "block", None)
        if not isinstance(blocks, nn.ModuleList) or not blocks or not hasattr(blocks[0], "layer"):
            continue
        first: Any = blocks[0]
        source = _t5_attention(first.layer[0])[0].relative_attention_bias
        block: Any
        for block in blocks:
            for sub in block.layer:
                attn, is_self = _t5_attention(sub)
                if attn is None or getattr(attn, "_ph_own_bias", False):
                    continue
                if "position_bias" not in inspect.signature(attn.forward).parameters:
                    continue
                if is_self and not attn.has_relative_attention_bias:
                    table = nn.Embedding(
                        source.num_embeddings,
                        source.embedding_dim,
                        device=source.weight.device,
                        dtype=source.weight.dtype,
                    )
                    with torch.no_grad():
                        table.weight.copy_(source.weight)
                    attn.relative_attention_bias = table
                    attn.has_relative_attention_bias = True
                attn.register_forward_pre_hook(_drop_shared_position_bias, with_kwargs=True)
                attn._ph_own_bias = True


def _drop_shared_position_bias(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    kwargs["position_bias"] = None
    return args, kwargs


def _heads(module: Any) -> int:
    """The head count a module keeps under one of the common names (for layouts that keep no head size)."""
    names = ("num_heads", "num_attention_heads", "n_head", "n_heads")
    return next(getattr(module, n) for n in names if hasattr(module, n))


def _falcon_layout(module: Any) -> str:
    """Falcon's fused layout: per KV group (new architecture), one shared KV head (multi-query), or per head."""
    if module.new_decoder_architecture:
        return "groups"
    return "blocks" if module.multi_query else "heads"


def _per_head_argument(class_name: str, argument: str, position: int, dim: int, batch_major: bool = False):
    """A `prepare` for families whose model hands every layer one tensor with a slice per ORIGINAL head
    (a relative position bias, ALiBi slopes): each `class_name` module gets a forward pre-hook that keeps
    the slices of the heads it still has, along `dim` of `argument` (or positional `position`).
    `batch_major`: the tensor is [batch * heads, ...] (BLOOM)."""

    def select(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        present = getattr(module, "_ph_present", None)
        value = kwargs.get(argument, args[position] if len(args) > position else None)
        if present is None or value is None:
            return args, kwargs
        index = torch.tensor(present, dtype=torch.long, device=value.device)
        if batch_major:
            heads = module._ph_record["num_heads"]
            value = value.reshape(-1, heads, *value.shape[1:]).index_select(1, index).reshape(-1, *value.shape[1:])
        else:
            value = value.index_select(dim, index)
        if argument in kwargs:
            kwargs[argument] = value
        else:
            args = (*args[:position], value, *args[position + 1 :])
        return args, kwargs

    def prepare(model: nn.Module) -> None:
        module: Any
        for module in model.modules():
            if type(module).__name__ == class_name and not getattr(module, "_ph_head_argument", False):
                module.register_forward_pre_hook(select, with_kwargs=True)
                module._ph_head_argument = True

    return prepare


_BERT_UPDATES = (("self", "num_attention_heads", "heads"), ("self", "all_head_size", "inner"))
_LLAMA_TYPES = (
    "LlamaAttention",
    "MistralAttention",
    "Qwen2Attention",
    "Qwen3Attention",
    "GemmaAttention",
    "Gemma2Attention",
    "Gemma3Attention",
    "OlmoAttention",
    "GraniteAttention",
    "StarcoderAttention",
    "SmolLM3Attention",
    "CohereAttention",
    "GlmAttention",
)
# those whose rotary embedding turns the pairs (i, i + head_dim / 2) (transformers' rotate_half): Cohere and GLM
# interleave theirs
ROTATE_HALF = frozenset(_LLAMA_TYPES) - {"CohereAttention", "GlmAttention"}
_BART_TYPES = (
    "BartAttention",
    "WhisperAttention",
    "MBartAttention",
    "MarianAttention",
    "PegasusAttention",
    "M2M100Attention",
    "BlenderbotAttention",
    "NllbMoeAttention",
    "PLBartAttention",
)

FAMILIES: list[AttentionSpec] = [
    AttentionSpec(
        "bert",
        (
            "BertAttention",
            "RobertaAttention",
            "XLMRobertaAttention",
            "ElectraAttention",
            "CamembertAttention",
            "RobertaPreLayerNormAttention",
            "XmodAttention",
        ),
        q="self.query",
        k="self.key",
        v="self.value",
        o="output.dense",
        head_dim="self.attention_head_size",
        updates=_BERT_UPDATES,
        no_heads="self",
    ),
    AttentionSpec(
        "albert",
        ("AlbertAttention",),
        q="query",
        k="key",
        v="value",
        o="dense",
        head_dim="attention_head_size",
        updates=(("", "num_attention_heads", "heads"), ("", "all_head_size", "inner")),
    ),
    AttentionSpec(
        "distilbert",
        ("DistilBertSelfAttention",),
        q="q_lin",
        k="k_lin",
        v="v_lin",
        o="out_lin",
        head_dim="attention_head_size",
        updates=(("", "n_heads", "heads"),),
        no_heads="",
    ),
    AttentionSpec(
        "deberta-v2",
        ("DebertaV2Attention",),
        q="self.query_proj",
        k="self.key_proj",
        v="self.value_proj",
        o="output.dense",
        head_dim="self.attention_head_size",
        updates=_BERT_UPDATES,
        per_head_out=("self.pos_key_proj", "self.pos_query_proj"),
        no_heads="self",
    ),
    AttentionSpec(
        "mpnet",
        ("MPNetSelfAttention",),
        q="q",
        k="k",
        v="v",
        o="o",
        head_dim="attention_head_size",
        updates=(("", "num_attention_heads", "heads"), ("", "all_head_size", "inner")),
        prepare=_per_head_argument("MPNetSelfAttention", "position_bias", 2, dim=1),
        no_heads="",
        no_heads_outputs=1,
    ),
    AttentionSpec("modernbert", ("ModernBertAttention",), fused_qkv="Wqkv", o="Wo", head_dim="head_dim"),
    AttentionSpec(
        "gpt2",
        ("GPT2Attention",),
        fused_qkv="c_attn",
        o="c_proj",
        head_dim="head_dim",
        updates=(("", "num_heads", "heads"), ("", "split_size", "inner")),
        no_heads="",
    ),
    AttentionSpec(
        "opt",
        ("OPTAttention",),
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="out_proj",
        head_dim="head_dim",
        grouped=True,
        updates=(("", "num_heads", "heads"),),
        no_heads="",
    ),
    AttentionSpec(
        "bart",
        _BART_TYPES,
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="out_proj",
        head_dim="head_dim",
        updates=(("", "num_heads", "heads"),),
        no_heads="",
    ),
    AttentionSpec(
        "llama",
        _LLAMA_TYPES,
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="o_proj",
        head_dim="head_dim",
        grouped=True,
        updates=(("", "num_key_value_groups", "kv_groups"),),
        no_heads="",
    ),
    AttentionSpec(
        "phi",
        ("PhiAttention",),
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="dense",
        head_dim="head_dim",
        grouped=True,
        updates=(("", "num_key_value_groups", "kv_groups"),),
        no_heads="",
    ),
    AttentionSpec(
        "phi3",
        ("Phi3Attention",),
        fused_qkv="qkv_proj",
        o="o_proj",
        head_dim="head_dim",
        grouped=True,
        updates=(
            ("", "num_key_value_groups", "kv_groups"),
            ("", "num_key_value_heads", "kv_heads"),
            ("config", "num_attention_heads", "heads"),
        ),
    ),
    AttentionSpec(
        "t5",
        ("T5Attention", "MT5Attention", "UMT5Attention"),
        q="q",
        k="k",
        v="v",
        o="o",
        head_dim="key_value_proj_dim",
        updates=(("", "n_heads", "heads"), ("", "inner_dim", "inner")),
        per_head_columns=("relative_attention_bias.weight",),
        prepare=_t5_own_position_bias,
    ),
    AttentionSpec(
        "vit",
        ("ViTAttention", "DeiTAttention", "ViTMAEAttention", "Dinov2Attention"),
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="o_proj",
        head_dim="head_dim",
        updates=(("", "num_attention_heads", "heads"),),
        no_heads="",
    ),
    # after the general layouts above, which structural matching tries first
    AttentionSpec(
        "gpt-neox",
        ("GPTNeoXAttention",),
        fused_qkv="query_key_value",
        fused_layout="heads",
        o="dense",
        head_dim="head_size",
        no_heads="",
    ),
    AttentionSpec(
        "bloom",
        ("BloomAttention",),
        fused_qkv="query_key_value",
        fused_layout="heads",
        o="dense",
        head_dim="head_dim",
        updates=(("", "num_heads", "heads"),),
        prepare=_per_head_argument("BloomAttention", "alibi", 2, dim=0, batch_major=True),
    ),
    AttentionSpec(
        "mpt",
        ("MptAttention",),
        fused_qkv="Wqkv",
        o="out_proj",
        head_dim="head_dim",
        updates=(("", "n_heads", "heads"),),
        prepare=_per_head_argument("MptAttention", "position_bias", 1, dim=0),
    ),
    AttentionSpec(
        "gpt-bigcode",
        ("GPTBigCodeAttention",),
        fused_qkv="c_attn",
        o="c_proj",
        head_dim="head_dim",
        grouped=True,
        updates=(("", "num_heads", "heads"), ("", "embed_dim", "inner"), ("", "num_key_value_groups", "kv_groups")),
        no_heads="",
    ),
    AttentionSpec(
        "vit-legacy",
        (),
        q="attention.query",
        k="attention.key",
        v="attention.value",
        o="output.dense",
        head_dim="attention.attention_head_size",
        updates=(("attention", "num_attention_heads", "heads"), ("attention", "all_head_size", "inner")),
    ),
    # layouts known only by structure (no class is registered for them; the probe proves each module)
    AttentionSpec("wq", (), q="Wq", k="Wk", v="Wv", o="dense", head_dim="head_dim"),
    AttentionSpec("wo", (), q="q_proj", k="k_proj", v="v_proj", o="Wo", head_dim="head_dim", grouped=True),
    AttentionSpec("qkv-proj", (), fused_qkv="qkv", o="proj", head_dim=lambda m: m.qkv.out_features // 3 // _heads(m)),
    AttentionSpec("c-attn", (), fused_qkv="c_attn", o="c_proj", head_dim=lambda m: m.split_size // m.n_head),
    AttentionSpec(
        "attention-qkv",
        (),
        fused_qkv="attention.qkv",
        o="output.dense",
        head_dim=lambda m: m.attention.qkv.out_features // 3 // m.attention.num_heads,
        updates=(("attention", "num_heads", "heads"),),
    ),
    AttentionSpec(
        "linear-q",
        (),
        q="linear_q",
        k="linear_k",
        v="linear_v",
        o="linear_out",
        head_dim=lambda m: m.linear_q.out_features // _heads(m),
    ),
    AttentionSpec(
        "projection-layer",
        (),
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="projection_layer",
        head_dim="head_dim",
        grouped=True,
    ),
    AttentionSpec("query-proj", (), q="query", k="key", v="value", o="proj", head_dim="attention_head_size"),
    AttentionSpec(
        "qwen3-next",
        ("Qwen3NextAttention",),
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="o_proj",
        head_dim="head_dim",
        grouped=True,
        q_blocks=2,
        updates=(("", "num_key_value_groups", "kv_groups"),),
        no_heads="",
    ),
    AttentionSpec(
        "falcon",
        ("FalconAttention",),
        fused_qkv="query_key_value",
        fused_layout=_falcon_layout,
        o="dense",
        head_dim="head_dim",
        grouped=True,
        # num_key_value_groups: transformers 5.25's Falcon repeats its KV heads by it
        updates=(
            ("", "num_heads", "heads"),
            ("", "num_kv_heads", "kv_heads"),
            ("", "num_key_value_groups", "kv_groups"),
        ),
        no_heads="",
    ),
    AttentionSpec(
        "gptj",
        ("GPTJAttention",),
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="out_proj",
        head_dim="head_dim",
        updates=(("", "num_attention_heads", "heads"),),
    ),
    AttentionSpec(
        "xglm",
        ("XGLMAttention",),
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="out_proj",
        head_dim="head_dim",
        updates=(("", "num_heads", "heads"), ("", "embed_dim", "inner")),
        no_heads="",
    ),
    AttentionSpec(
        "stablelm",
        ("StableLmAttention",),
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="o_proj",
        head_dim="head_dim",
        grouped=True,
        updates=(
            ("", "num_heads", "heads"),
            ("", "num_key_value_heads", "kv_heads"),
            ("", "num_key_value_groups", "kv_groups"),
        ),
        per_head_lists=("q_layernorm.norms",),
        per_kv_head_lists=("k_layernorm.norms",),
        no_heads="",
    ),
]


# attention classes whose heads cannot be removed exactly, and why (refused by find_attention)
NOT_EXACT: dict[str, str] = {
    "BigBirdAttention": "it rebuilds its attention module from the config when it switches between block-sparse "
    "and full attention at run time, which undoes any removal",
}


def register_family(spec: AttentionSpec) -> None:
    """Add an attention family to the table, ahead of the built-in ones so it can override them.

    Example: `register_family(AttentionSpec("mine", ("MyAttention",), q="wq", k="wk", v="wv", o="wo",
    head_dim="head_dim", updates=(("", "n_heads", "heads"),)))`. A name registered already is refused
    (ValueError: this module imports only torch and transformers, for standalone checkpoints).
    """
    if any(found.name == spec.name for found in FAMILIES):
        raise ValueError(f"an attention family named {spec.name!r} is registered already; give yours another name")
    FAMILIES.insert(0, spec)


def spec_for_type(type_name: str) -> AttentionSpec | None:
    """The registered spec whose module_types names this class, or None."""
    return next((spec for spec in FAMILIES if type_name in spec.module_types), None)
