"""Calibration text the unpruned model writes itself (self-calibration, Williams et al., NAACL 2025), added
beside a language model's calibration batches: the plan, the refits, the tuning and the held-out checks that
keep them then see the model's own broad distribution as well as the user's domain, so that what is fitted to
that domain does not cost the model elsewhere (measured on SmolLM2: benchmarks/README.md)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig

from ..data import input_device

SHARE = 0.375  # written examples per calibration example: 3 for every 8
TOP_P = 0.95  # nucleus sampling at temperature 1: the model's own distribution without its unlikely tail


def writes_text(model: nn.Module) -> bool:
    """Whether `model` writes text on its own: a decoder-only language model (it generates, no encoder)."""
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate and can_generate()) and not getattr(model.config, "is_encoder_decoder", False)


def token_batches(batches: list[dict]) -> bool:
    """Whether every batch holds token ids (`input_ids`, examples x positions) to write text beside."""
    return all(torch.is_tensor(b.get("input_ids")) and b["input_ids"].dim() == 2 for b in batches)


@torch.no_grad()
def with_generated(model: nn.Module, batches: list[dict], share: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(all batches, the generated ones): after each calibration batch, a batch of sequences as wide as it, as
    many as bring the written ones to `round(share * the examples so far)` (3 for every 8 examples at the
    default share, whatever the batch size), sampled from `model` (temperature 1, top-p 0.95), each started from
    the first token of one of the batch's examples, with the tokens themselves as labels where the batch has
    labels. Sampled under `seed` without touching the caller's random state: the same inputs and seed give the
    same text."""
    lm: Any = model  # a transformers model: its config and generate()
    device = input_device(model)
    devices = [device] if device.type == "cuda" else []
    out: list[dict] = []
    generated: list[dict] = []
    seen = written = 0
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for batch in batches:
            out.append(batch)
            ids = batch["input_ids"]
            seen += ids.shape[0]
            rows, width = round(share * seen) - written, ids.shape[1]  # the share of all examples so far
            if rows == 0 or width < 2:
                continue
            mask = batch.get("attention_mask", torch.ones_like(ids)).bool()
            first = torch.stack([row[keep][0] if keep.any() else row[0] for row, keep in zip(ids, mask)])
            prompt = first[torch.arange(rows) % len(first)].unsqueeze(1).to(device)
            sampling = GenerationConfig(
                do_sample=True,
                temperature=1.0,
                top_p=TOP_P,
                top_k=0,
                max_new_tokens=width - 1,
                min_new_tokens=width - 1,
                eos_token_id=lm.config.eos_token_id,  # suppressed up to the batch's width (min_new_tokens)
                pad_token_id=lm.config.pad_token_id if lm.config.pad_token_id is not None else 0,
            )
            tokens = lm.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=sampling)
            tokens = tokens[:, :width].to(ids.device)
            extra = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
            if "labels" in batch:
                extra["labels"] = tokens.clone()
            out.append(extra)
            generated.append(extra)
            written += rows
    return out, generated
