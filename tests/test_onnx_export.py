"""Pruned models export with plain torch.onnx.export and run in ONNX Runtime with the same outputs."""

import contextlib
import io
import json

import onnxruntime as ort
import pytest
import tiny_models as tm
import torch
from torch.export import Dim
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import prune_heads as ph


def _export(model, inputs: dict, path, dynamic: bool = False) -> ort.InferenceSession:
    shapes = None
    if dynamic:
        batch, sequence = Dim("batch"), Dim("sequence")
        shapes = {k: {0: batch, 1: sequence} for k in inputs}
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter narrates its steps
        torch.onnx.export(model, (), str(path), kwargs=dict(inputs), dynamic_shapes=shapes, dynamo=True)
    return ort.InferenceSession(str(path))


def _run(session: ort.InferenceSession, inputs: dict) -> torch.Tensor:
    return torch.from_numpy(session.run(None, {k: v.numpy() for k, v in inputs.items()})[0])


class MainOutput(torch.nn.Module):
    """Logits or the last hidden state, without a cache (a cache object is no ONNX output)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.extra = {"use_cache": False} if "use_cache" in model.config else {}

    def forward(self, **inputs):
        return tm.main_output(self.model(**inputs, **self.extra))


# Qwen3-Next's linear-attention (Gated DeltaNet) layers take 90 s to export with or without pruning; its
# attention layers are the same shape of code as Qwen3's, which exports here.
SLOW_TO_EXPORT = {"qwen3-next"}


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in tm.FAMILIES if n not in SLOW_TO_EXPORT])
def test_every_family_exports_after_uneven_pruning(name, tmp_path):
    model, inputs = tm.build(name), tm.make_inputs(name)
    ph.prune(model, tm.uneven_plan(ph.find_attention(model)))  # one layer loses every head
    with torch.no_grad():
        expected = tm.main_output(model(**inputs))
    got = _run(_export(MainOutput(model), inputs, tmp_path / "m.onnx"), inputs)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_pruned_gpt2_exports_with_dynamic_batch_and_length(tmp_path):
    model = tm.build("gpt2")
    ph.prune(model, tm.uneven_plan(ph.find_attention(model)))
    model.config.use_cache = False
    session = _export(model, tm.make_inputs("gpt2", batch=2, seq=7), tmp_path / "gpt2.onnx", dynamic=True)
    other = tm.make_inputs("gpt2", batch=3, seq=11, seed=5)
    with torch.no_grad():
        expected = model(**other).logits
    torch.testing.assert_close(_run(session, other), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_pruned_fixture_bert_exports_with_dynamic_batch_and_length(fixture_model_path, fixture_data_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(fixture_model_path)
    model = AutoModelForSequenceClassification.from_pretrained(fixture_model_path).eval()
    ph.prune(model, {i: list(range(i % 2, 12, 2)) for i in range(6)})  # half of every layer
    lines = (fixture_data_path / "test.jsonl").read_text().splitlines()
    sentences = [json.loads(line)["sentence"] for line in lines]

    def encode(texts):
        return dict(tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt"))

    session = _export(model, encode(sentences[:2]), tmp_path / "bert.onnx", dynamic=True)
    other = encode(sentences[2:18])
    with torch.no_grad():
        expected = model(**other).logits
    got = _run(session, other)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
