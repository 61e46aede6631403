"""Calibration text the unpruned model writes itself (self-calibration, Williams et al., NAACL 2025), added
beside a language model's calibration batches when `recovery.generated_share` asks for it: the plan, the
refits, the tuning and the held-out checks that keep them then see the model's own broad distribution as well
as the user's domain. It moves the cost of pruning from other text to that domain, at a rate that depends on
the model (SmolLM2 and Gemma 3: benchmarks/README.md, the frontier), so it is off by default."""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import torch
from torch import nn

from ..runtime import parallel
from ..runtime.devices import input_device
from ..runtime.progress import progress_bar
from ..scoring.objective import frozen
from ..task_data import DataError

WRITTEN_EXAMPLES = 128  # sequences a decoder writes to calibrate on when no data is given
TOP_P = 0.95  # nucleus sampling at temperature 1: the model's own distribution without its unlikely tail
NUCLEUS_WIDTHS = (256, 2048)  # SmolLM2's nuclei at 0.95: median 189 tokens, 90% within 1,924, 99% within 5,078
WRITE_TOKENS = 32768  # written at once: a step reads the weights once for all its rows (faster to 128 rows of 256)


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


def nucleus(probs: torch.Tensor, top_p: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each row's nucleus of `probs` (rows x vocabulary): the most likely tokens whose mass before them is under
    `top_p` (the most likely one always), as (probabilities, token ids), most likely first. Looked for among a
    row's `NUCLEUS_WIDTHS` most likely tokens before all of them (a full sort of the vocabulary cost two thirds
    of a written token), so a row's nucleus depends on its own probabilities only."""
    found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    left = torch.arange(len(probs))
    for width in (*NUCLEUS_WIDTHS, probs.shape[-1]):
        values, tokens = probs[left.to(probs.device)].topk(min(width, probs.shape[-1]), -1)
        kept = (values.cumsum(-1) - values < top_p).sum(-1).clamp(min=1)
        values, tokens, kept = values.cpu(), tokens.cpu(), kept.cpu()  # one copy a width, not one a row
        ends = (kept < values.shape[-1]) | (width >= probs.shape[-1])  # the nucleus ends inside these tokens
        for row, v, t, n in zip(left[ends].tolist(), values[ends], tokens[ends], kept[ends].tolist()):
            found[row] = (v[:n], t[:n])
        left = left[~ends]
        if not len(left):
            break
    return [found[row] for row in range(len(probs))]


def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` (rows x vocabulary), sampled from the row's `nucleus` at `TOP_P` with its own
    CPU generator: token ids, rows x 1, on the CPU."""
    drawn = [t[torch.multinomial(v, 1, generator=g)] for (v, t), g in zip(nucleus(probs, TOP_P), generators)]
    return torch.stack(drawn)


def row_generator(seed: int, length: int, row: int) -> torch.Generator:
    """The CPU generator that row `row` of the text written `length` tokens long with `seed` draws from: one per
    row, so a row's text does not depend on the rows written beside it or on the process that writes it."""
    digest = hashlib.sha256(f"{seed}:{length}:{row}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def sample(model: nn.Module, prompt: torch.Tensor, new_tokens: int, generators: list[torch.Generator]) -> torch.Tensor:
    """`prompt` (rows x 1 token ids) and `new_tokens` tokens more, sampled from `model` with its KV cache at
    temperature 1 and top-p `TOP_P`, the end-of-text tokens held back so every row is as long as asked. Row i
    draws from `generators[i]` on the CPU, so the same seeds write the same text on any device (a CUDA
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
            tokens = torch.cat([tokens, draw(logits.softmax(-1), generators).to(tokens.device)], 1)
    return tokens


@torch.no_grad()
def write(model: nn.Module, prompts: torch.Tensor, length: int, seed: int, what: str, progress: bool) -> torch.Tensor:
    """`prompts` (rows x 1 token ids) each `sample`d on to `length` tokens, row i from `row_generator(seed,
    length, i)`: the rows shared out over the data-parallel processes, each writing `WRITE_TOKENS` at a time,
    then joined, so every process holds all of them (on the CPU). The same model, prompts and seed write the
    same text at any number of processes (but for a draw within float rounding of a boundary)."""
    mine, width, device = parallel.share(len(prompts)), max(1, WRITE_TOKENS // length), input_device(model)
    parts = [torch.empty(0, length, dtype=torch.long)]
    for first in progress_bar(range(mine.start, mine.stop, width), what, enabled=progress):
        rows = range(first, min(first + width, mine.stop))
        generators = [row_generator(seed, length, i) for i in rows]
        parts.append(sample(model, prompts[rows.start : rows.stop].to(device), length - 1, generators).cpu())
    return parallel.joined(torch.cat(parts))


def with_generated(model: nn.Module, batches: list[dict], share: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(all batches, the generated ones): after each calibration batch, a batch of sequences as wide as it, as
    many as bring the written ones to `round(share * the examples so far)` (3 for every 8 examples at the
    default share, whatever the batch size), `write`n from `prompts` of the batch, with the tokens themselves as
    labels where the batch has labels. The same inputs and seed give the same text on any device, the caller's
    random state untouched."""
    written = _written_rows(batches, share)
    text: dict[int, torch.Tensor] = {}
    for width in sorted({b["input_ids"].shape[1] for b, rows in zip(batches, written) if rows}):
        chosen = [i for i, rows in enumerate(written) if rows and batches[i]["input_ids"].shape[1] == width]
        starts = torch.cat([prompts(batches[i], written[i]) for i in chosen]).cpu()
        tokens = write(model, starts, width, seed, "writing calibration text", progress=False)
        text.update(zip(chosen, tokens.split([written[i] for i in chosen])))
    out: list[dict] = []
    generated: list[dict] = []
    for i, batch in enumerate(batches):
        out.append(batch)
        if i not in text:
            continue
        tokens = text[i].to(batch["input_ids"].device)
        extra = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
        if "labels" in batch:
            extra["labels"] = tokens.clone()
        out.append(extra)
        generated.append(extra)
    return out, generated


def _written_rows(batches: list[dict], share: float) -> list[int]:
    """The rows written after each batch: as many as bring them to `round(share * the examples so far)` (none
    beside a batch narrower than 2 tokens, nothing to write on)."""
    rows, seen, written = [], 0, 0
    for batch in batches:
        ids = batch["input_ids"]
        seen += ids.shape[0]
        count = round(share * seen) - written if ids.shape[1] >= 2 else 0
        rows.append(count)
        written += count
    return rows


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
    token where there is none) and `write`n on, the tokens their own labels. The same model and seed write the
    same text."""
    start = start_token(model)
    if start is None or length < 2:
        raise DataError(
            "--data is required: only a decoder-only language model with a beginning- or end-of-text token "
            "calibrates on text it writes itself (and only with --max-length 2 or more)"
        )
    tokens = write(model, torch.full((examples, 1), start), length, seed, "writing calibration text", progress)
    return [
        {"input_ids": t, "attention_mask": torch.ones_like(t), "labels": t.clone()} for t in tokens.split(batch_size)
    ]
