"""Calibration text the unpruned model writes itself (self-calibration, Williams et al., NAACL 2025), added
beside a language model's calibration batches when `recovery.generated_share` asks for it: the plan, the
refits, the tuning and the held-out checks that keep them then see the model's own broad distribution as well
as the user's domain. It moves the cost of pruning from other text to that domain, at a rate that depends on
the model (SmolLM2 and Gemma 3: benchmarks/README.md, the frontier), so it is off by default."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..runtime.devices import input_device
from ..runtime.progress import progress_bar
from ..scoring.objective import frozen
from ..task_data import DataError

SHARE = 0.375  # written examples per calibration example, the share measured: 3 for every 8
WRITTEN_EXAMPLES = 128  # sequences a decoder writes to calibrate on when no data is given
TOP_P = 0.95  # nucleus sampling at temperature 1: the model's own distribution without its unlikely tail


def writes_text(model: nn.Module) -> bool:
    """Whether `model` writes text on its own: a decoder-only language model (it generates, no encoder)."""
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate and can_generate()) and not getattr(model.config, "is_encoder_decoder", False)


def token_batches(batches: list[dict]) -> bool:
    """Whether every batch holds token ids (`input_ids`, examples x positions) to write text beside."""
    return all(torch.is_tensor(b.get("input_ids")) and b["input_ids"].dim() == 2 for b in batches)


def prompts(batch: dict, rows: int) -> torch.Tensor:
    """The one-token prompts (rows x 1) the written text starts from: the first attended token of the batch's
    examples in turn."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask", torch.ones_like(ids)).bool()
    first = torch.stack([row[keep][0] if keep.any() else row[0] for row, keep in zip(ids, mask)])
    return first[torch.arange(rows) % len(first)].unsqueeze(1)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` (rows x vocabulary) with each row's unlikely tail set to 0: only the most likely tokens whose mass
    before them is under `top_p` stay (the most likely one always does)."""
    ordered, order = probs.sort(-1, descending=True)
    tail = ordered.cumsum(-1) - ordered >= top_p
    tail[:, 0] = False
    ordered[tail] = 0
    return torch.zeros_like(probs).scatter(-1, order, ordered)


def sample(model: nn.Module, prompt: torch.Tensor, new_tokens: int, generator: torch.Generator) -> torch.Tensor:
    """`prompt` (rows x 1 token ids) and `new_tokens` tokens more, sampled from `model` with its KV cache at
    temperature 1 and top-p `TOP_P`, the end-of-text tokens held back so every row is as long as asked. The
    draws come from `generator` on the CPU, so the same seed writes the same text on any device (a CUDA
    generator's stream differs from the CPU's; only a draw within float rounding of a boundary can differ)."""
    lm: Any = model  # a transformers model: its config and KV cache
    ends = lm.config.eos_token_id
    ends = [] if ends is None else [ends] if isinstance(ends, int) else list(ends)
    named = "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"  # by version
    tokens, cache = prompt, None
    with frozen(model):
        for _ in range(new_tokens):
            out = lm(tokens[:, -1:], attention_mask=torch.ones_like(tokens), use_cache=True, **{named: cache})
            cache, logits = out[named], out.logits[:, -1].float()
            logits[:, ends] = -torch.inf
            drawn = torch.multinomial(nucleus(logits.softmax(-1), TOP_P).cpu(), 1, generator=generator)
            tokens = torch.cat([tokens, drawn.to(tokens.device)], 1)
    return tokens


@torch.no_grad()
def with_generated(model: nn.Module, batches: list[dict], share: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(all batches, the generated ones): after each calibration batch, a batch of sequences as wide as it, as
    many as bring the written ones to `round(share * the examples so far)` (3 for every 8 examples at the
    default share, whatever the batch size), `sample`d from `model`, each started from `prompts`, with the
    tokens themselves as labels where the batch has labels. Drawn from a generator seeded with `seed`: the same
    inputs and seed give the same text on any device, the caller's random state untouched."""
    device = input_device(model)
    generator = torch.Generator().manual_seed(seed)
    out: list[dict] = []
    generated: list[dict] = []
    seen = written = 0
    for batch in batches:
        out.append(batch)
        ids = batch["input_ids"]
        seen += ids.shape[0]
        rows, width = round(share * seen) - written, ids.shape[1]  # the share of all examples so far
        if rows == 0 or width < 2:
            continue
        tokens = sample(model, prompts(batch, rows).to(device), width - 1, generator).to(ids.device)
        extra = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
        if "labels" in batch:
            extra["labels"] = tokens.clone()
        out.append(extra)
        generated.append(extra)
        written += rows
    return out, generated


def start_token(model: nn.Module) -> int | None:
    """The token a decoder-only language model's own text starts from: its beginning-of-text token, else its
    end-of-text token (None where it has neither, or writes no text)."""
    config: Any = getattr(model, "config", None)
    starts = (getattr(config, "bos_token_id", None), getattr(config, "eos_token_id", None))
    start = next((t for t in starts if t is not None), None)
    if not writes_text(model) or start is None:
        return None
    return start if isinstance(start, int) else start[0]


@torch.no_grad()
def written_batches(
    model: nn.Module, examples: int, batch_size: int, length: int, seed: int, progress: bool = True
) -> list[dict]:
    """Calibration batches the model writes itself, for a decoder given no data: `examples` sequences of
    `length` tokens in batches of `batch_size`, each `sample`d from the beginning-of-text token (the end-of-text
    token where there is none), the tokens their own labels. The same model and seed write the same text."""
    start = start_token(model)
    if start is None or length < 2:
        raise DataError(
            "--data is required: only a decoder-only language model with a beginning- or end-of-text token "
            "calibrates on text it writes itself (and only with --max-length 2 or more)"
        )
    generator = torch.Generator().manual_seed(seed)
    out = []
    for first in progress_bar(range(0, examples, batch_size), "writing calibration text", enabled=progress):
        rows = min(batch_size, examples - first)
        prompt = torch.full((rows, 1), start, dtype=torch.long, device=input_device(model))
        tokens = sample(model, prompt, length - 1, generator).cpu()
        out.append({"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": tokens.clone()})
    return out
