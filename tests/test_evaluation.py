import math

import pytest
import torch
import transformers as T
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from prune_heads.data import load_task_data
from prune_heads.evaluation import MetricError, evaluate_task, fidelity, load_metric, perplexity


def test_fixture_accuracy_equals_a_plain_loop(fixture_model_path, fixture_data_path):
    tokenizer = AutoTokenizer.from_pretrained(fixture_model_path)
    model = AutoModelForSequenceClassification.from_pretrained(fixture_model_path).eval()
    data = load_task_data(str(fixture_data_path), tokenizer, split="test[:300]", batch_size=64)
    result = evaluate_task(model, data, ["accuracy", "f1", "matthews_correlation"], progress=False)
    rows = [__import__("json").loads(l) for l in (fixture_data_path / "test.jsonl").read_text().splitlines()[:300]]
    correct = 0
    with torch.no_grad():
        for row in rows:
            encoded = tokenizer(row["sentence"], truncation=True, max_length=128, return_tensors="pt")
            correct += int(model(**encoded).logits.argmax(-1).item() == row["label"])
    assert result["accuracy"] == pytest.approx(correct / 300, abs=1e-12)
    assert result["examples"] == 300 and 0 < result["f1"] < 1 and -1 <= result["matthews_correlation"] <= 1


def test_perplexity_is_exp_of_mean_token_nll(fixture_model_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(fixture_model_path)
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=2, n_head=4,
                                           n_positions=512)).eval()
    text = "the film is a charming, funny and moving story about friendship. " * 6
    (tmp_path / "t.txt").write_text(text)
    data = load_task_data(str(tmp_path / "t.txt"), tokenizer, task="causal-lm", split="train", text_column="text",
                          max_length=512)
    ids = tokenizer(text.strip(), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    result = perplexity(model, data, progress=False)
    assert result["perplexity"] == pytest.approx(math.exp(float(nll)), rel=1e-5)
    assert result["tokens"] == ids.shape[1] - 1


def test_fidelity_of_identical_and_permuted_embeddings():
    emb = torch.nn.functional.normalize(torch.randn(20, 8), dim=-1)
    assert fidelity(emb, emb) == {"cosine": pytest.approx(1.0), "cosine_min": pytest.approx(1.0),
                                  "nn_agreement": 1.0}
    shuffled = fidelity(emb, emb[torch.randperm(20)])
    assert shuffled["cosine"] < 0.9


def test_metrics_load_offline_and_unknown_ones_fail_clearly():
    assert load_metric("accuracy").compute(predictions=[1, 0], references=[1, 1]) == {"accuracy": 0.5}
    with pytest.raises(MetricError, match="cannot load metric 'no_such_metric_xyz'.*accuracy, f1"):
        load_metric("no_such_metric_xyz")
