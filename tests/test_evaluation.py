import math

import pytest
import torch
import transformers as T
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from prune_heads.evaluation.task import (
    MetricError,
    evaluate_task,
    evaluation,
    fidelity,
    load_metric,
    logistic_regression,
    nearest_vote,
    perplexity,
)
from prune_heads.task_data import load_task_data


@pytest.mark.slow
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
    model = T.GPT2LMHeadModel(
        T.GPT2Config(vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=512)
    ).eval()
    text = "the film is a charming, funny and moving story about friendship. " * 6
    (tmp_path / "t.txt").write_text(text)
    data = load_task_data(
        str(tmp_path / "t.txt"), tokenizer, task="causal-lm", split="train", text_column="text", max_length=512
    )
    ids = tokenizer(text.strip(), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    result = perplexity(model, data, progress=False)
    assert result["perplexity"] == pytest.approx(math.exp(float(nll)), rel=1e-5)
    assert result["tokens"] == ids.shape[1] - 1


def test_fidelity_of_identical_and_permuted_embeddings():
    emb = torch.nn.functional.normalize(torch.randn(20, 8), dim=-1)
    assert fidelity(emb, emb) == {"cosine": pytest.approx(1.0), "cosine_min": pytest.approx(1.0), "nn_agreement": 1.0}
    shuffled = fidelity(emb, emb[torch.randperm(20)])
    assert shuffled["cosine"] < 0.9


def test_metrics_load_offline_and_unknown_ones_fail_clearly():
    assert load_metric("accuracy").compute(predictions=[1, 0], references=[1, 1]) == {"accuracy": 0.5}
    with pytest.raises(MetricError, match="cannot load metric 'no_such_metric_xyz'.*accuracy, f1"):
        load_metric("no_such_metric_xyz")


def test_logistic_regression_is_mteb_s_classifier_and_knn_votes():
    """The torch logistic regression fits scikit-learn's default objective (C=1, L2, multinomial, MTEB's
    classifier): the same predictions; k-NN takes the majority of the k nearest by cosine."""
    from sklearn.linear_model import LogisticRegression

    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(3, 16, generator=generator)
    labels = torch.randint(0, 3, (300,), generator=generator)
    points = torch.nn.functional.normalize(centres[labels] + 1.5 * torch.randn(300, 16, generator=generator), dim=-1)
    train, test, y, truth = points[:200], points[200:], labels[:200], labels[200:]
    ours = logistic_regression(train, y, test)
    theirs = LogisticRegression(C=1.0, max_iter=1000, tol=1e-10).fit(train.numpy(), y.numpy()).predict(test.numpy())
    assert (ours.numpy() == theirs).mean() >= 0.99 and (ours == truth).float().mean() > 0.8
    anchors = torch.eye(3)
    assert nearest_vote(anchors.repeat(3, 1), torch.tensor([0, 1, 2] * 3), anchors, k=3).tolist() == [0, 1, 2]


def test_embedding_task_accuracy_with_labelled_splits(tmp_path):
    """Labels of a feature-extraction split go to `targets` (the model takes none); with a labelled train split
    the evaluation adds logistic-regression and k-NN accuracy, each with its per-example correctness."""
    import json

    import tiny_models as tm
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["good", "great", "fine", "bad", "awful", "poor"]
    rows = [{"text": " ".join(words[(i + j) % 3 + 3 * (i % 2)] for j in range(4)), "label": i % 2} for i in range(60)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    tok = Tokenizer(models.WordLevel({w: i + 2 for i, w in enumerate(words)} | {"[PAD]": 0, "[UNK]": 1}, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = T.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    train, test = (
        load_task_data(
            str(tmp_path / "d.jsonl"),
            tokenizer,
            task="feature-extraction",
            split=split,
            text_column="text",
            label_column="label",
            batch_size=8,
        )
        for split in ("train[:40]", "train[40:]")
    )
    assert all("labels" not in b for b in train.batches) and len(train.targets) == 40
    model = tm.build("bert").bert.eval()
    found = evaluation(model, test, train=train, progress=False)
    assert {"cosine", "nn_agreement", "logreg_accuracy", "knn_accuracy"} <= set(found.metrics)
    assert found.metrics["logreg_accuracy"] == found.correct["logreg_accuracy"].mean()
    assert found.statistics["knn_accuracy"].examples == 20
