"""The tokenizer in a GGUF file written from Hugging Face weights: llama.cpp's tokenizer model and
pre-tokenizer for it, the vocabulary and the scores that make llama.cpp tokenize text to the same ids."""

from __future__ import annotations

import json
import re
from typing import Any

from .architectures import FROM_SOURCE, GgufError

# llama.cpp's pre-tokenizers, by the splitting of a Hugging Face byte-level BPE tokenizer (tokenizer.json's
# pre_tokenizer): the regular expressions each applies, read from llama.cpp's llama-vocab.cpp
_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"


_LLAMA3 = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)


_QWEN2 = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)


PRE_TOKENIZERS: dict[tuple, str] = {
    (("ByteLevel", True),): "gpt-2",
    (("Digits", True), ("ByteLevel", True)): "smollm",
    (("Split", _LLAMA3), ("ByteLevel", False)): "llama-bpe",
    (("Split", _QWEN2), ("ByteLevel", False)): "qwen2",
}


def _signature(pre: dict | None) -> tuple:
    """A tokenizer.json pre_tokenizer as (kind, setting) steps: the regex of a Split, whether a ByteLevel
    splits with GPT-2's own, whether Digits splits single digits."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    out = []
    settings = {
        "Split": lambda s: s.get("pattern", {}).get("Regex"),
        "ByteLevel": lambda s: s.get("use_regex", True),
        "Digits": lambda s: s.get("individual_digits", False),
    }
    for step in steps:
        kind = step.get("type")
        out.append((kind, settings[kind](step) if kind in settings else None))
    return tuple(out)


def _backend(tokenizer: Any) -> dict:
    """A fast tokenizer's tokenizer.json as a dict ({} for a slow one)."""
    return json.loads(tokenizer.backend_tokenizer.to_str()) if getattr(tokenizer, "is_fast", False) else {}


def _byte_level(spec: dict) -> bool:
    model = spec.get("model", {})
    decoder = (spec.get("decoder") or {}).get("type")
    return model.get("type") == "BPE" and not model.get("byte_fallback") and decoder == "ByteLevel"


def _sentencepiece_style(spec: dict) -> bool:
    """BPE with byte fallback whose merges apply as listed (no dropout, no whole-word lookup first)."""
    model = spec.get("model", {})
    listed = not model.get("ignore_merges") and not model.get("dropout")
    return model.get("type") == "BPE" and bool(model.get("byte_fallback")) and listed


def _pre_tokenizer(spec: dict) -> str:
    """The llama.cpp pre-tokenizer that splits text as this byte-level BPE tokenizer does; GgufError when
    llama.cpp has none."""
    name = PRE_TOKENIZERS.get(_signature(spec.get("pre_tokenizer")))
    if name is None:
        raise GgufError(
            f"llama.cpp has no pre-tokenizer known to split text as this tokenizer does "
            f"({_signature(spec.get('pre_tokenizer'))}); {FROM_SOURCE}"
        )
    return name


_SPACES = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}


_PREFIX = {"type": "Prepend", "prepend": "\u2581"}


_NO_SPLIT: tuple[dict, ...] = (  # no pre-tokenizer, or Gemma's split at spaces (none are left after _SPACES)
    {},
    {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
)


def _space_prefix(spec: dict) -> bool:
    """Whether llama.cpp's sentencepiece tokenizer (`llama`) must put a space before text to split it as this
    sentencepiece-style tokenizer does; GgufError when it cannot split alike. llama.cpp turns spaces into ▁,
    prefixes one at the start and after every added token where add_space_prefix is set, and splits nothing
    else: the tokenizer must replace spaces by a normalizer, optionally after a Prepend, or by a Metaspace that
    does not split. (A Metaspace prefixes no second ▁ to text that starts with a space, and with
    prepend_scheme "first" none after an added token; llama.cpp, like sentencepiece, does.)"""
    normalizer, pre = spec.get("normalizer"), spec.get("pre_tokenizer") or {}
    steps = normalizer.get("normalizers", []) if normalizer and normalizer.get("type") == "Sequence" else [normalizer]
    if steps in ([_SPACES], [_PREFIX, _SPACES]) and pre in _NO_SPLIT:
        return steps[0] == _PREFIX
    if steps == [None] and pre.get("type") == "Metaspace" and (pre["replacement"], pre["split"]) == ("▁", False):
        return pre["prepend_scheme"] != "never"
    raise GgufError(
        f"llama.cpp's sentencepiece tokenizer cannot split text as this one does (normalizer "
        f"{[s and s.get('type') for s in steps]}, pre-tokenizer {pre.get('type')}: llama.cpp "
        f"replaces spaces, may prefix one and splits nothing); {FROM_SOURCE}"
    )


def _check_merges(tokenizer: Any, spec: dict) -> None:
    """llama.cpp's sentencepiece tokenizer merges, among neighbouring pieces, the pair whose joint text is the
    highest-scoring token, so any split of a token into two others is a merge to it: the tokenizer's merges
    must list every one (those converted from sentencepiece do); GgufError naming the first missing."""
    vocab = _ordinary_tokens(tokenizer, spec)
    merges = {tuple(_pair(m)) for m in spec["model"].get("merges", [])}
    for token in vocab:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab and (left, right) not in merges:
                raise GgufError(
                    f"the tokenizer's merges lack {left!r} + {right!r} (= {token!r}), which llama.cpp's "
                    f"sentencepiece tokenizer would merge; {FROM_SOURCE}"
                )


def _pair(merge: Any) -> list[str]:
    return merge if isinstance(merge, list) else merge.split(" ", 1)


def _ordinary_tokens(tokenizer: Any, spec: dict) -> set[str]:
    """The tokens BPE makes: the vocabulary less the added tokens (which both split off text first)."""
    added = {t.content for t in tokenizer.added_tokens_decoder.values()}
    return {t for t in spec.get("model", {}).get("vocab", {}) if t not in added}


def tokenizer_model(tokenizer: Any) -> str:
    """llama.cpp's tokenizer model for this Hugging Face tokenizer: `gpt2` for byte-level BPE (with the
    pre-tokenizer that splits alike), `llama` for sentencepiece-style BPE (Llama 2, Mistral, Phi-3, Gemma:
    byte fallback, spaces as ▁; `_space_prefix`, `_check_merges`). GgufError, naming --gguf-file, for any
    other kind or one llama.cpp cannot split alike."""
    spec = _backend(tokenizer)
    if _byte_level(spec):
        _pre_tokenizer(spec)
        return "gpt2"
    if _sentencepiece_style(spec):
        _space_prefix(spec)
        _check_merges(tokenizer, spec)
        return "llama"
    raise GgufError(
        f"{type(tokenizer).__name__} is neither byte-level nor sentencepiece-style BPE, the kinds written from "
        f"Hugging Face weights; {FROM_SOURCE}"
    )


def _vocabulary(tokenizer: Any, size: int, bytes_as_tokens: bool) -> tuple[list[str], list[int]]:
    """Every id's token text and GGUF token type: special added tokens are CONTROL (so llama.cpp parses them
    in text, as transformers does), other added ones USER_DEFINED, the unknown token UNKNOWN; with
    `bytes_as_tokens` (sentencepiece style) <0xNN> tokens are BYTE, what llama.cpp falls back to; ids the
    tokenizer lacks, up to the embedding's size, are unused padding."""
    import gguf

    by_id = {i: text for text, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(size):
        text = by_id.get(i)
        tokens.append(f"[PAD{i}]" if text is None else text)
        if text is None:
            types.append(gguf.TokenType.UNUSED)
        elif bytes_as_tokens and i == tokenizer.unk_token_id:
            types.append(gguf.TokenType.UNKNOWN)
        elif i in added:
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        elif bytes_as_tokens and re.fullmatch(r"<0x[0-9A-F]{2}>", text):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _scores(tokenizer: Any, spec: dict, tokens: list[str]) -> list[float]:
    """Scores that make llama.cpp's sentencepiece tokenizer merge in the tokenizer's order: a token made by
    merges scores minus the rank of the first merge that makes it (llama.cpp merges the highest first); the
    others (characters, bytes, added tokens), which no merge of llama.cpp's makes, score 0."""
    ordinary = _ordinary_tokens(tokenizer, spec)
    first: dict[str, int] = {}
    for rank, merge in enumerate(spec["model"]["merges"]):
        first.setdefault("".join(_pair(merge)), rank)
    return [-float(first[t]) if t in first and t in ordinary else 0.0 for t in tokens]
