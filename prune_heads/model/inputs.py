"""Random inputs of the shape a model takes, for proofs, FLOP counts and timings that need no data."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch


def _sub_config(config: Any, key: str, default: Any = None) -> Any:
    """`config.key`, else the value in its vision or audio sub-config (multimodal models)."""
    for part in (config, getattr(config, "vision_config", None), getattr(config, "audio_config", None)):
        if part is not None and getattr(part, key, None) is not None:
            return getattr(part, key)
    return default


def dummy_inputs(model: torch.nn.Module, batch_size: int, seq_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs of the shape the model takes, one for each input its forward names: token ids (with their
    mask, and decoder ids for encoder-decoders), pixels (vision), log-mel features or waveforms (speech)."""
    config: Any = model.config
    g = torch.Generator().manual_seed(seed)
    accepted = inspect.signature(model.forward).parameters
    main_input = getattr(model, "main_input_name", "input_ids")
    inputs: dict[str, torch.Tensor] = {}
    if main_input == "input_features":
        frames = 2 * config.max_source_positions
        inputs["input_features"] = torch.randn(batch_size, config.num_mel_bins, frames, generator=g)
    elif main_input == "input_values":
        samples = seq_len * math.prod(getattr(config, "conv_stride", (320,))) + 400
        inputs["input_values"] = torch.randn(batch_size, samples, generator=g)
    if "pixel_values" in accepted and (main_input == "pixel_values" or hasattr(config, "vision_config")):
        size = _sub_config(config, "image_size", 224)
        height, width = (size, size) if isinstance(size, int) else tuple(size)[-2:]
        channels = _sub_config(config, "num_channels", 3)
        frames = _sub_config(config, "num_frames")  # video models take [batch, frames, channels, h, w]
        shape = (batch_size, *([frames] if frames else []), channels, height, width)
        inputs["pixel_values"] = torch.randn(*shape, generator=g)
    if "input_ids" in accepted and (main_input == "input_ids" or hasattr(config, "text_config")):
        ids = torch.randint(5, config.get_text_config().vocab_size, (batch_size, seq_len), generator=g)
        inputs["input_ids"] = ids
        if "attention_mask" in accepted:
            inputs["attention_mask"] = torch.ones_like(ids)
    if config.is_encoder_decoder and "decoder_input_ids" in accepted:
        inputs["decoder_input_ids"] = torch.ones(batch_size, max(seq_len // 4, 1), dtype=torch.long)
    return inputs
