"""End-to-end tests of the CLI on the shared fixture (click's runner and a real subprocess)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import prune_heads as ph
from prune_heads.cli import main
from prune_heads.data import load_task_data
from prune_heads.evaluation import evaluate_task
from conftest import FAST

def test_run_writes_a_loadable_model_and_a_true_report(fixture_run, fixture_model_path, fixture_data_path):
    out, proc = fixture_run
    assert "| accuracy |" in proc.stdout and "Saved the model and report to" in proc.stdout
    for name in ("report.json", "report.md", "heatmap.png", "heads_per_layer.png", "plan.json", "scores.json",
                 "recipe.yaml"):
        assert (out / name).exists(), name
    assert (out / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
    report = json.loads((out / "report.json").read_text())
    model = ph.load_pruned(out)
    assert sum(l.num_heads for l in ph.find_attention(model)) == 36
    data = load_task_data(str(fixture_data_path), AutoTokenizer.from_pretrained(out), split="test",
                          max_examples=300, batch_size=64)
    fresh = evaluate_task(model, data, ["accuracy", "f1"], progress=False)
    assert report["after"]["metrics"]["accuracy"] == pytest.approx(fresh["accuracy"], abs=1e-12)
    assert report["after"]["metrics"]["f1"] == pytest.approx(fresh["f1"], abs=1e-12)
    assert report["summary"]["heads"] == {"before": 72, "after": 36, "removed": 36}
    assert report["after"]["speed"]["flops"] < report["before"]["speed"]["flops"]


def test_existing_output_is_refused_and_left_alone(fixture_run):
    out, _ = fixture_run
    before = sorted(p.name for p in out.iterdir())
    result = CliRunner().invoke(main, ["run", "fixture-minilm-sentiment", "-o", str(out), *FAST])
    assert result.exit_code == 2
    assert "already exists; choose another folder or pass overwrite=True (--force)" in result.output
    assert sorted(p.name for p in out.iterdir()) == before


def _invoke(args):
    return CliRunner().invoke(main, args)


def test_recipe_typo_is_named(tmp_path):
    recipe = Path(__file__).parents[1] / "recipes" / "fixture-minilm-sentiment.yaml"
    (tmp_path / "typo.yaml").write_text(recipe.read_text().replace("score_split", "scor_split"))
    result = _invoke(["run", str(tmp_path / "typo.yaml"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1].startswith("error: unknown key data.scor_split: did you mean")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, message", [
    (["--set", "selection.sparsity=1.0"], "cannot remove sparsity 1.0 (72 more heads)"),
    (["--set", "data.text_column=review"], "no text column 'review'; the data has columns idx, sentence, label"),
])
def test_impossible_requests_leave_nothing_behind(tmp_path, extra, message):
    result = _invoke(["run", "fixture-minilm-sentiment", "-o", str(tmp_path / "out"), *FAST, *extra])
    assert result.exit_code == 2 and message in result.output
    assert list(tmp_path.iterdir()) == []


def test_plan_that_empties_a_layer_needs_min_heads_zero(tmp_path, fixture_model_path, fixture_data_path):
    (tmp_path / "plan.json").write_text(json.dumps({"0": list(range(12))}))
    args = ["prune", str(fixture_model_path), "--data", str(fixture_data_path), "--plan", str(tmp_path / "plan.json"),
            "-o", str(tmp_path / "out")]
    result = _invoke(args)
    assert result.exit_code == 2 and "leaves bert.encoder.layer.0.attention with 0 heads" in result.output
    assert not (tmp_path / "out").exists()
    result = _invoke(args + ["--min-heads-per-layer", "0", "--standalone"])
    assert result.exit_code == 0, result.output
    assert ph.find_attention(ph.load_pruned(tmp_path / "out"))[0].num_heads == 0
    remote = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out", trust_remote_code=True)
    assert type(remote).__name__ == "PrunedBertForSequenceClassification"
    assert ph.find_attention(remote)[0].num_heads == 0


def test_unknown_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["FancyNet"]}))
    result = _invoke(["inspect", str(tmp_path / "m")])
    assert result.exit_code == 2 and "unknown architecture ['FancyNet']" in result.output


def test_score_and_evaluate_and_inspect(tmp_path, fixture_model_path, fixture_data_path):
    common = ["--data", str(fixture_data_path), "--examples", "64", "--batch-size", "32"]
    result = _invoke(["score", str(fixture_model_path), *common, "--method", "taylor", "-o", str(tmp_path / "s")])
    assert result.exit_code == 0, result.output
    scores = ph.HeadScores.load(tmp_path / "s" / "scores.json")
    assert scores.method == "taylor" and scores.num_examples == 64 and len(scores.layers) == 6
    assert (tmp_path / "s" / "heatmap.png").exists()
    result = _invoke(["evaluate", str(fixture_model_path), *common, "--split", "test", "--no-speed", "--json"])
    assert result.exit_code == 0, result.output
    assert 0.5 < json.loads(result.stdout)["metrics"]["accuracy"] <= 1
    result = _invoke(["inspect", str(fixture_model_path), "--json"])
    assert json.loads(result.stdout)["heads"] == 72


def test_every_command_has_help_with_an_example():
    for command in main.commands:
        result = _invoke([command, "--help"])
        assert result.exit_code == 0 and "Example:" in result.output, command
    assert _invoke(["prune", "m", "--data", "d", "-o", "x"]).exit_code == 2  # no --sparsity/--plan: bad usage
