"""Saving and loading pruned models.

A pruned checkpoint is a normal transformers checkpoint whose config also records, per attention layer,
the original head counts and the removed heads (`config.prune_heads`). Loading builds the model from its
config, re-applies the surgery, and only then loads the weights, through `from_pretrained` itself.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from .layers import UnsupportedModelError, find_attention
from .standalone import standalone_config, write_code
from .surgery import RECORD_KEY, reapply_record


logger = logging.getLogger("prune_heads")


class OutputExistsError(FileExistsError):
    """Raised when a save would overwrite an existing folder without `overwrite=True`."""


def _pruned_subclass(base: type) -> type:
    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        reapply_record(self, getattr(config, RECORD_KEY, None))

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__})


def model_class(config, gguf: bool = False) -> type:
    """The transformers class named by `config.architectures[0]`; for a GGUF file, whose config names none,
    the causal language model of the config's type."""
    architectures = getattr(config, "architectures", None) or []
    if not architectures and gguf and type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if not architectures or not hasattr(transformers, architectures[0]):
        raise UnsupportedModelError(f"unknown architecture {architectures!r} in the model's config.json: name a "
                                    f"transformers model class there (as save_pretrained records it)")
    return getattr(transformers, architectures[0])


def load_pruned(path: str | os.PathLike, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a model saved by `save_pruned` (or `model.save_pretrained` after `prune`).

    Works for unpruned checkpoints too, and for a GGUF file in the folder (`gguf_file=`; transformers
    dequantizes it). Keyword arguments go to `from_pretrained` (dtype, device_map, revision, gguf_file, ...).
    The model comes back as an instance of its ordinary transformers class.
    """
    config = AutoConfig.from_pretrained(path, **{k: v for k, v in from_pretrained_kwargs.items()
                                                 if k in ("revision", "token", "trust_remote_code", "gguf_file")})
    base = model_class(config, gguf="gguf_file" in from_pretrained_kwargs)
    model = _pruned_subclass(base).from_pretrained(path, **from_pretrained_kwargs)
    model.__class__ = base
    return model


def ensure_free(target: Path, overwrite: bool) -> None:
    """Raise OutputExistsError when `target` exists and `overwrite` is False."""
    if Path(target).exists() and not overwrite:
        raise OutputExistsError(f"{target} already exists; choose another folder or pass overwrite=True (--force)")


def replace_folder(target: Path, overwrite: bool, write) -> Path:
    """Call `write(tmp_dir)` and move the result to `target` in one rename; nothing half-written is left.

    Raises OutputExistsError when `target` exists and `overwrite` is False.
    """
    target = Path(target)
    ensure_free(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            os.replace(target, old / "replaced")
            os.replace(tmp, target)
            shutil.rmtree(old)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


_STOCK_FAMILIES = ("llama",)  # families whose config can state per-model head counts natively


def stock_config(model: nn.Module) -> Any | None:
    """A plain config for a pruned model whose every layer kept the same heads and KV heads, for families
    whose config says so natively (Llama, Mistral, Qwen2/3, Gemma...): num_attention_heads,
    num_key_value_heads and head_dim set (and `attention_bias` when pruning added output biases and the
    class reads it), the prune record moved to `pruned_from`. None otherwise, and None unless the class
    built from it has exactly the model's weights (missing ones may only be biases, saved as zeros)."""
    config = getattr(model, "config", None)
    layers = find_attention(model)
    record = getattr(config, RECORD_KEY, None)
    if not record or not layers or any(l.spec.name not in _STOCK_FAMILIES for l in layers):
        return None
    shapes = {(l.num_heads, l.num_kv_heads, l.head_dim) for l in layers}
    if len(shapes) != 1 or next(iter(shapes))[0] == 0:
        return None
    heads, kv_heads, head_dim = shapes.pop()
    stock = copy.deepcopy(config)
    stock.num_attention_heads, stock.num_key_value_heads, stock.head_dim = heads, kv_heads, head_dim
    delattr(stock, RECORD_KEY)
    stock.pruned_from = record
    if stock_fill(model, stock) is None and hasattr(stock, "attention_bias") and not stock.attention_bias:
        stock.attention_bias = True  # pruning added output biases: q/k/v get zero ones
    return stock if stock_fill(model, stock) is not None else None


def stock_fill(model: nn.Module, config: Any) -> dict[str, torch.Tensor] | None:
    """The zero biases to save beside the model's weights so that its class, built from `config`, loads them
    exactly; None when that class's weights differ from the model's in any other way."""
    with torch.device("meta"):
        shell = type(model)(config)
    expected = {k: v.shape for k, v in shell.state_dict().items()}
    own = model.state_dict()
    if any(k not in expected or expected[k] != v.shape for k, v in own.items()):
        return None
    missing = {k: shape for k, shape in expected.items() if k not in own}
    if not all(k.endswith(".bias") for k in missing):
        return None
    reference = next(iter(own.values()))
    return {k: torch.zeros(shape, dtype=reference.dtype) for k, shape in missing.items()}


def save_pruned(model: nn.Module, path: str | os.PathLike, tokenizer: Any = None, overwrite: bool = False,
                standalone: bool = False) -> Path:
    """Save a (pruned) model, and its tokenizer or processor if given, so `load_pruned` restores it exactly.

    When every layer kept the same heads and the family's config can say so (Llama-style), the saved config
    is a stock one (see `stock_config`): plain `AutoModelForCausalLM.from_pretrained` and other runtimes load
    it with no code of ours. Otherwise `standalone=True` writes a small modeling file and an `auto_map` into
    the checkpoint, so `AutoModel*.from_pretrained(path, trust_remote_code=True)` loads it where prune_heads
    is not installed (see `prune_heads.standalone`). The folder is written under a temporary name and
    renamed into place, so an interrupted save leaves no half-written model. Raises OutputExistsError if
    `path` exists and `overwrite` is False.
    """
    return replace_folder(Path(path), overwrite, lambda tmp: write_model(model, tmp, tokenizer, standalone))


def drop_gguf_quantizer(model: nn.Module) -> bool:
    """Forget that `model` was loaded from a GGUF file (transformers already dequantized its weights, but
    marks it quantized and refuses to save it): drop the quantizer and `quantization_config`, say so once.
    Returns whether there was one. Other quantizers are left alone."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is None or getattr(method, "value", method) != "gguf":
        return False
    quantizer.remove_quantization_config(model)
    logger.warning("the model was loaded from a GGUF file: it is saved dequantized, as %s safetensors "
                   "(its GGUF quantizer is dropped)", str(next(model.parameters()).dtype).replace("torch.", ""))
    return True


def write_model(model: nn.Module, folder: Path, tokenizer: Any = None, standalone: bool = False) -> None:
    """Write the model (with a stock config when `stock_config` gives one, else with remote code when
    `standalone`) and its tokenizer into an existing folder; `save_pruned` and the pipeline write through here.
    A model loaded from GGUF is written dequantized (see `drop_gguf_quantizer`)."""
    drop_gguf_quantizer(model)
    config = stock_config(model)
    standalone_code = config is None and standalone and getattr(model.config, RECORD_KEY, None)
    if standalone_code:
        config = standalone_config(model)
        write_code(model, folder)
    original = model.config
    fill = stock_fill(model, config) if config is not None and not standalone_code else None
    if config is not None:
        model.config = config
    try:
        model.save_pretrained(folder, state_dict={**model.state_dict(), **fill} if fill else None)
    finally:
        model.config = original
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
