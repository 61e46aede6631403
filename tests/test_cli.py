"""End-to-end tests of the CLI on the shared fixture (click's runner and a real subprocess)."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models
import torch
from click.testing import CliRunner
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedTokenizerFast

import prune_heads as ph
from prune_heads.cli import main
from prune_heads.evaluation.task import evaluate_task
from prune_heads.recipes import load_recipe
from prune_heads.recovery.general import OFF, WRITTEN
from prune_heads.task_data import load_task_data


@pytest.mark.slow
def test_run_writes_a_loadable_model_and_a_true_report(fixture_run, fixture_model_path, fixture_data_path):
    out, proc = fixture_run
    assert "| accuracy |" in proc.stdout and "Saved the model and report to" in proc.stdout
    assert "scoring heads" not in proc.stderr  # stderr is not a terminal: no progress bars
    for name in (
        "report.json",
        "report.md",
        "heatmap.png",
        "heads_per_layer.png",
        "plan.json",
        "scores.json",
        "recipe.yaml",
        "analysis.html",
        "analysis.json",
    ):
        assert (out / name).exists(), name
    assert (out / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
    report = json.loads((out / "report.json").read_text())
    model = ph.load_pruned(out)
    assert sum(l.num_heads for l in ph.find_attention(model)) == 36
    data = load_task_data(
        str(fixture_data_path), AutoTokenizer.from_pretrained(out), split="test", max_examples=300, batch_size=64
    )
    fresh = evaluate_task(model, data, ["accuracy", "f1"], progress=False)
    assert report["after"]["metrics"]["accuracy"] == pytest.approx(fresh["accuracy"], abs=1e-12)
    assert report["after"]["metrics"]["f1"] == pytest.approx(fresh["f1"], abs=1e-12)
    assert report["summary"]["heads"] == {"before": 72, "after": 36, "removed": 36}
    assert report["after"]["speed"]["flops"] < report["before"]["speed"]["flops"]
    accuracy = report["summary"]["metrics"]["accuracy"]  # with its paired interval and McNemar's p-value
    assert accuracy["low"] <= accuracy["delta"] <= accuracy["high"] and 0 <= accuracy["p_value"] <= 1
    assert report["changes"]["f1"]["examples"] == 300 and isinstance(accuracy["noise"], bool)
    markdown = (out / "report.md").read_text()
    assert "95% CI" in markdown and "McNemar p = " in markdown and ("within noise" in markdown or "real, " in markdown)
    assert "Work, counted in FLOPs" in markdown and report["meta"]["work"]["calibration_pass"] > 0
    assert "[analysis.html](analysis.html)" in markdown  # the heads page, the removed heads marked on it
    assert "36 heads removed (red crosses)" in (out / "analysis.html").read_text()


def test_existing_output_is_refused_and_left_alone(fixture_run):
    out, _ = fixture_run
    before = sorted(p.name for p in out.iterdir())
    result = CliRunner().invoke(main, ["run", "fixture-minilm-sentiment", "-o", str(out), *tiny_models.FAST])
    assert result.exit_code == 2
    assert "already exists and is not empty; choose another folder or pass overwrite=True (--force)" in result.output
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


@pytest.mark.fixtures
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--set", "selection.sparsity=1.0"], "cannot remove exactly sparsity 1.0 (72 more heads)"),
        (["--set", "data.text_column=review"], "no text column 'review'; the data has columns idx, sentence, label"),
    ],
)
def test_impossible_requests_leave_nothing_behind(tmp_path, extra, message):
    result = _invoke(["run", "fixture-minilm-sentiment", "-o", str(tmp_path / "out"), *tiny_models.FAST, *extra])
    assert result.exit_code == 2 and message in result.output
    assert list(tmp_path.iterdir()) == []


def test_plan_that_empties_a_layer_needs_min_heads_zero(tmp_path, fixture_model_path):
    (tmp_path / "plan.json").write_text(json.dumps({"0": list(range(12))}))
    args = ["prune", str(fixture_model_path), "--plan", str(tmp_path / "plan.json"), "-o", str(tmp_path / "out")]
    result = _invoke(args)
    assert result.exit_code == 2 and "leaves bert.encoder.layer.0.attention with 0 heads" in result.output
    assert not (tmp_path / "out").exists()
    result = _invoke(args + ["--min-heads-per-layer", "0", "--standalone"])
    assert result.exit_code == 0, result.output
    assert ph.find_attention(ph.load_pruned(tmp_path / "out"))[0].num_heads == 0
    remote = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out", trust_remote_code=True)
    assert type(remote).__module__.endswith("modeling_prune_heads")  # the checkpoint's own code
    assert type(remote).__name__ == "BertForSequenceClassification"
    assert ph.find_attention(remote)[0].num_heads == 0


@pytest.mark.parametrize(
    "content, message",
    [
        ("[[0, 1]]", "must hold a JSON object"),
        ('{"0": [0, 1', "is not valid JSON"),
        ('{"0": [0], "shared_kv_heads": [[1, 0]]}', '"shared_kv_heads" must hold'),
    ],
)
def test_bad_plan_files_name_the_file(tmp_path, fixture_model_path, content, message):
    (tmp_path / "plan.json").write_text(content)
    result = _invoke(
        ["prune", str(fixture_model_path), "--plan", str(tmp_path / "plan.json"), "-o", str(tmp_path / "o")]
    )
    assert result.exit_code == 2 and message in result.output and "plan.json" in result.output
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_prune_without_flags_is_the_default_path(tmp_path, fixture_model_path, fixture_data_path):
    result = _invoke(
        [
            "prune",
            str(fixture_model_path),
            "--data",
            str(fixture_data_path),
            "--examples",
            "128",
            "--sparsity",
            "0.5",
            "-o",
            str(tmp_path / "out"),
            "--json",
        ]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["meta"]["method"] == "fisher" and report["summary"]["heads"]["after"] == 36
    steps = [e["step"] for e in report["recovery"]]
    assert steps == ["notes", "selection", "gate, bias and projection tuning"]  # a classifier: the guard off
    assert report["recovery"][0]["notes"] == [OFF]
    tried = set(report["recovery"][1]["tried"])
    assert {"ranked", "interactions + reconstruction", "fluctuation + reconstruction", "OBS + reconstruction"} <= tried
    assert report["meta"]["heldout"]["final"] <= report["meta"]["heldout"]["plain"]
    tuning = report["recovery"][2]
    assert isinstance(tuning["averaged"], bool)  # whether the moving average or the last step was kept
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "Recovery, decided on" in markdown
    assert ("moving average" in markdown) == (tuning["averaged"] and tuning["kept"])
    off = _invoke(
        [
            "prune",
            str(fixture_model_path),
            "--data",
            str(fixture_data_path),
            "--examples",
            "128",
            "--sparsity",
            "0.5",
            "--no-recovery",
            "-o",
            str(tmp_path / "off"),
            "--json",
        ]
    )
    assert off.exit_code == 0 and [e["step"] for e in json.loads(off.stdout)["recovery"]] == ["selection"]
    assert list(json.loads(off.stdout)["recovery"][0]["tried"]) == ["ranked"]
    flags = ["--examples", "128", "--sparsity", "0.5", "--steps", "2", "--no-recovery", "--json"]
    iterative = _invoke(
        ["prune", str(fixture_model_path), "--data", str(fixture_data_path), *flags, "-o", str(tmp_path / "it")]
    )
    report = json.loads(iterative.stdout)
    assert iterative.exit_code == 0 and [h["heads_removed"] for h in report["history"]] == [0, 18, 36]
    assert report["summary"]["heads"]["removed"] == 36 and report["recovery"] == []


def test_a_budget_the_structure_cannot_meet_is_refused_before_data(tmp_path):
    import tiny_models as tm

    tm.build("llama").save_pretrained(tmp_path / "llama")  # no tokenizer, and the data does not exist
    args = [
        "prune",
        str(tmp_path / "llama"),
        "--data",
        str(tmp_path / "missing.jsonl"),
        "--task",
        "causal-lm",
        "-o",
        str(tmp_path / "o"),
    ]
    result = _invoke([*args, "--num-heads", "3"])
    assert result.exit_code == 2 and "cannot remove exactly 3 heads" in result.output
    assert "2 heads (sparsity 0.1667) or 4 heads (sparsity 0.3333)" in result.output and "--round" in result.output
    result = _invoke([*args, "--sparsity", "0.1"])  # never silently an unpruned model
    assert result.exit_code == 2 and "0 heads (sparsity 0.0000) or 2 heads" in result.output
    assert not (tmp_path / "o").exists()
    for budget, message in (
        ("0.5MiB@8192", "removing the most the structure allows (6 heads as whole KV groups) leaves 768.00 KiB"),
        ("2MiB@8192", "the KV cache is 1.50 MiB at 8,192 tokens (f16), already within 2.00 MiB"),
        ("1MiB@8192:q8_0", "head size 8 does not split into q8_0's blocks of 32"),
        ("1MiB", "give SIZE@TOKENS[:TYPE]"),
    ):
        result = _invoke([*args, "--kv-cache", budget])
        assert result.exit_code == 2 and message in result.output and len(result.output.splitlines()) == 1, budget
    for more, message in (
        (["--max-loss", "0"], "selection.max_loss is 0.0; give a percentage above 0"),
        (["--max-loss", "3", "--no-recovery"], "it needs recovery on with holdout above 0"),
        (["--max-loss", "3", "--no-reconstruction"], "it needs recovery on with holdout above 0 and reconstruction"),
        (["--max-loss", "3", "--uniform"], "takes units one at a time: not with uniform"),
    ):
        result = _invoke([*args, *more])
        assert result.exit_code == 2 and message in result.output and len(result.output.splitlines()) == 1, more
    for more in (["--num-heads", "2"], ["--sparsity", "0.5", "--steps", "2"]):  # asked, never dropped silently
        result = _invoke([*args, *more, "--no-recovery", "--generated-share", "0.375"])
        assert result.exit_code == 2 and "generated_share is 0.375, but recovery is off" in result.output, more
        assert "drop --no-recovery" in result.output and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_smollm2_gguf_recipe_end_to_end(tmp_path):
    """The shipped GGUF recipe, shortened: GGUF in, pruned by whole KV groups, GGUF out; then as safetensors."""
    out = tmp_path / "smol"
    result = _invoke(
        [
            "run",
            "smollm2-135m-gguf",
            "-o",
            str(out),
            "--set",
            "data.score_split=train[:24]",
            "--set",
            "data.eval_split=train[24:32]",
            "--set",
            "data.max_length=64",
            "--set",
            "selection.num_heads=9",
            "--set",
            "recovery.epochs=1",
            "--set",
            "recovery.search_rounds=0",  # GGUF in and out under test; the search has its own (tests/test_search.py)
            "--set",
            "evaluation.speed.seq_len=8",
            "--set",
            "evaluation.speed.generate_tokens=4",
            "--set",
            "evaluation.speed.repeats=1",
            "--set",
            "evaluation.speed.warmup=0",
        ]
    )
    assert result.exit_code == 0, result.output
    shown = json.loads(_invoke(["inspect", str(out / "model.gguf"), "--json"]).stdout)
    assert sum(shown["heads"]) == 261 and sum(shown["kv_heads"]) == 87 and shown["source_sha256"]
    report = json.loads((out / "report.json").read_text())
    assert report["summary"]["heads"] == {"before": 270, "after": 261, "removed": 9}
    before, after = report["before"]["speed"]["generation"], report["after"]["speed"]["generation"]
    assert [g["batch_size"] for g in after] == [1, 8]
    assert all(a["kv_cache_bytes"] < b["kv_cache_bytes"] for a, b in zip(after, before))  # 3 of 90 KV heads gone
    assert "| generated tokens/s (batch 8, 4 new tokens)" in (out / "report.md").read_text()
    result = _invoke(
        [
            "run",
            "smollm2-135m-gguf",
            "-o",
            str(tmp_path / "st"),
            "--set",
            "output.format=safetensors",
            "--set",
            "data.score_split=train[:8]",
            "--set",
            "data.max_length=32",
            "--set",
            "selection.num_heads=9",
            "--set",
            "recovery=off",
            "--set",
            "evaluation.speed=null",
            "--set",
            "data.eval_split=null",
        ]
    )
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "st" / "config.json").read_text())
    assert "quantization_config" not in config and (tmp_path / "st" / "model.safetensors").exists()
    model = ph.load_pruned(tmp_path / "st")
    assert sum(l.num_kv_heads for l in ph.find_attention(model)) == 87
    result = _invoke(["inspect", str(tmp_path / "st"), "--json"])
    assert json.loads(result.stdout)["heads"] == 261


def test_bad_input_is_one_line_and_exit_two(tmp_path, fixture_model_path, fixture_data_path):
    from transformers import ResNetConfig, ResNetForImageClassification

    common = ["--data", str(fixture_data_path), "-o", str(tmp_path / "o")]
    for flag in ("--examples", "--batch-size"):
        result = _invoke(["prune", str(fixture_model_path), *common, "--sparsity", "0.5", flag, "0"])
        assert result.exit_code == 2 and "0 is not in the range x>=1" in result.output, flag
    (tmp_path / "empty.jsonl").write_text("")
    result = _invoke(["evaluate", str(fixture_model_path), "--data", str(tmp_path / "empty.jsonl"), "--no-speed"])
    assert result.exit_code == 2 and "has no examples" in result.output
    result = _invoke(["analyze", str(fixture_model_path), "--data", str(tmp_path / "empty.jsonl"), *common[2:]])
    assert result.exit_code == 2 and "has no examples" in result.output
    result = _invoke(["evaluate", str(fixture_model_path), "--data", str(fixture_data_path), "--task", "causal-lm"])
    assert result.exit_code == 2
    assert "is BertForSequenceClassification: use --task classification" in result.output.splitlines()[-1]
    resnet = ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1]))
    resnet.save_pretrained(tmp_path / "resnet")
    for command in (
        ["inspect"],
        ["score", "--task", "image-classification", *common[:2]],
        ["prune", "--task", "image-classification", "--sparsity", "0.5", *common],
        ["evaluate", "--task", "image-classification", *common[:2]],
        ["analyze", "--task", "image-classification", *common],
    ):
        result = _invoke([command[0], str(tmp_path / "resnet"), *command[1:]])
        assert result.exit_code == 2, command
        assert result.output.strip() == (
            f"error: no attention layers found in {tmp_path / 'resnet'} (ResNetForImageClassification)"
        )
    for missing in (str(tmp_path / "nope"), "./nope"):
        result = _invoke(["inspect", missing])
        assert result.exit_code == 2
        assert (
            result.output.strip() == f"error: no folder {missing}, and not a hub id (those look like "
            f"'org/name'); check the path"
        )
    assert not (tmp_path / "o").exists()


def test_an_edited_record_is_exit_two_naming_the_layer(tmp_path):
    model = tiny_models.build("bert")
    ph.prune(model, {0: [0, 1]})
    ph.save_pruned(model, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["prune_heads"]["layers"]["bert.encoder.layer.0.attention"]["removed"] = [0, 9]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    result = _invoke(["inspect", str(tmp_path / "m")])
    assert result.exit_code == 2
    assert result.output.strip() == (
        "error: config.prune_heads layer 'bert.encoder.layer.0.attention': removed "
        "head(s) [9] are not heads 0..3; restore the config.json that save_pruned wrote"
    )


@pytest.mark.slow
def test_quiet_leaves_stderr_empty_and_json_clean(tmp_path, fixture_model_path, fixture_data_path):
    args = [
        sys.executable,
        "-m",
        "prune_heads.cli",
        "-q",
        "prune",
        str(fixture_model_path),
        "--data",
        str(fixture_data_path),
        "--examples",
        "16",
        "--num-heads",
        "6",
        "--method",
        "magnitude",
        "--no-recovery",
        "--json",
        "-o",
        str(tmp_path / "o"),
    ]
    proc = subprocess.run(args, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert json.loads(proc.stdout)["summary"]["heads"]["removed"] == 6


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


def test_analyze_writes_the_page_and_its_json_and_refuses_an_existing_folder(
    tmp_path, fixture_model_path, fixture_data_path
):
    args = ["analyze", str(fixture_model_path), "--data", str(fixture_data_path), "--examples", "64"]
    result = _invoke([*args, "-o", str(tmp_path / "a"), "--json"])
    assert result.exit_code == 0, result.output
    found = ph.Analysis.load(tmp_path / "a" / "analysis.json")
    assert (
        json.loads(result.stdout) == json.loads(json.dumps(found.to_dict()))
        and found.examples == 64
        and len(found.layers) == 6
    )
    assert found.unit == "head" and [c.heads for c in found.costs] == [12, 24, 36, 48]
    assert (tmp_path / "a" / "analysis.html").read_text().count("data:image/png;base64,") == 5  # no KV heads
    again = _invoke([*args, "-o", str(tmp_path / "a")])
    assert again.exit_code == 2 and len(again.output.strip().splitlines()) == 1
    assert "already exists and is not empty" in again.output


def test_every_command_has_help_with_an_example():
    for command in main.commands:
        result = _invoke([command, "--help"])
        assert result.exit_code == 0 and "Example:" in result.output, command
    assert _invoke(["prune", "m", "--data", "d", "-o", "x"]).exit_code == 2  # no --sparsity/--plan: bad usage
    assert "fisher|fluctuation|gradient" in _invoke(["prune", "--help"]).output  # the methods registered


def test_inspect_lists_the_attention_it_leaves_alone(tmp_path):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        num_hidden_layers=2,
        vocab_size=300,
    )
    vision = dict(
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        num_hidden_layers=2,
        image_size=32,
        patch_size=8,
        vision_use_head=True,
    )
    Gemma3ForConditionalGeneration(
        Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    ).save_pretrained(tmp_path / "gemma3")
    result = _invoke(["inspect", str(tmp_path / "gemma3")])
    assert result.exit_code == 0, result.output
    assert (
        "model.vision_tower.head                          left as it is (SiglipMultiheadAttentionPoolingHead): "
        "an attention module of no registered family"
    ) in result.output
    unsupported = json.loads(_invoke(["inspect", str(tmp_path / "gemma3"), "--json"]).stdout)["unsupported"]
    assert [u["class"] for u in unsupported] == ["SiglipMultiheadAttentionPoolingHead"]


def test_input_errors_are_one_line_and_anything_else_shows_its_traceback(tmp_path, monkeypatch):
    """A `PruneHeadsError` is input to fix: one line and exit 2, its traceback only under --traceback; any
    other exception is a bug and is not hidden behind a line."""
    missing = str(tmp_path / "no-model-here")
    result = _invoke(["inspect", missing])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1 and "no-model-here" in result.output
    result = _invoke(["--traceback", "inspect", missing])
    assert isinstance(result.exception, ph.PruneHeadsError) and result.exit_code == 1

    def bug(*args, **kwargs):
        raise RuntimeError("a bug")

    tiny_models.build("bert").save_pretrained(tmp_path / "bert")
    monkeypatch.setattr("prune_heads.cli.scan_required", bug)
    result = _invoke(["inspect", str(tmp_path / "bert")])
    assert isinstance(result.exception, RuntimeError) and result.exit_code == 1 and "error:" not in result.output


@pytest.mark.parametrize("config", [ph.SelectionConfig, ph.ScoringConfig, ph.RecoveryConfig])
def test_every_config_field_is_a_prune_option_with_its_documentation_or_says_it_is_not(config):
    """A field's one line of documentation is its option's --help (and docs/cli-reference.md); a field that is
    not on the command says so (`cli=False`: recipes and the API only)."""
    options = {name: p for p in main.commands["prune"].params for name in p.opts}
    for field in dataclasses.fields(config):
        assert field.metadata["help"], f"{config.__name__}.{field.name} has no documentation"
        if not field.metadata["cli"]:
            continue
        flag = field.metadata["flag"] or "--" + field.name.replace("_", "-")
        assert flag in options, f"{config.__name__}.{field.name}: no {flag} on prune-heads prune"
        assert options[flag].help == field.metadata["help"], flag


def test_the_prune_line_says_what_the_held_out_data_measured():
    from types import SimpleNamespace

    from prune_heads.cli import heldout_line

    measured = SimpleNamespace(meta={"heldout": {"final": 0.01234, "plain": 0.04567}})
    assert heldout_line(measured) == (
        " (held-out divergence from the unpruned model 0.01234; the plain selection's 0.04567)"
    )
    assert heldout_line(SimpleNamespace(meta={"heldout": {"final": None, "plain": None}})) == ""  # nothing held out
    language = SimpleNamespace(meta={"heldout": {"final": 0.01, "plain": 0.02, "perplexity_change": 0.0141}})
    assert heldout_line(language).endswith("the plain selection's 0.02; held-out perplexity +1.4%)")
    guarded = {**language.meta["heldout"], "general_perplexity_change": 0.052, "general": {"source": WRITTEN}}
    assert heldout_line(SimpleNamespace(meta={"heldout": guarded})).endswith(
        "held-out perplexity +1.4%, on the model's own text +5.2%)"
    )


def _tiny_llama_folder(tmp_path: Path, model=None) -> Path:
    """A tiny Llama (3 layers x 2 KV groups of 2 query heads, head size 8; `model` where given) with a
    word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word: i for i, word in enumerate(["<pad>", "<s>", "</s>", "<unk>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>")
    (model or tiny_models.build("llama")).save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


WORDS = ["the", "film", "was", "good", "and", "bad", "with", "a", "plot", "that", "made", "no", "sense"]


def test_a_kv_cache_budget_prunes_the_fewest_groups_and_says_the_size(tmp_path):
    """`--kv-cache` on a tiny Llama (1.5 MiB at 8,192 tokens in f16): 1 MiB takes two whole groups, and the
    line and the report say the size reached."""
    folder = _tiny_llama_folder(tmp_path)
    (tmp_path / "data.txt").write_text("\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))))
    args = ["prune", str(folder), "--data", str(tmp_path / "data.txt"), "--text-column", "text"]
    args += ["--task", "causal-lm"]
    result = _invoke([*args, "--kv-cache", "1MiB@8192", "--no-recovery", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "removed 4 heads" in result.output and "its KV cache 1.00 MiB at 8,192 tokens (f16)" in result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["meta"]["kv_cache"] == {
        "budget": "1.00 MiB at 8,192 tokens (f16)",
        "limit": 2**20,
        "context": 8192,
        "type": "f16",
        "size": 2**20,
    }
    assert ph.kv_cache_size(ph.load_pruned(tmp_path / "out"), 8192) == 2**20


@pytest.mark.slow
def test_a_kv_cache_budget_shares_kv_heads_where_that_measures_better_and_says_so(tmp_path):
    """`--kv-cache` at half the planted tiny Llama's cache (each layer's KV head 1 a scale of its 0): the groups
    are emptied by sharing, every query head kept, and the line and the report say so; the frontier measures
    its depth shared too, in a row and a plan file of its own; `--no-kv-sharing` removes them."""
    folder = _tiny_llama_folder(tmp_path, tiny_models.planted_llama())
    (tmp_path / "data.txt").write_text("\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))))
    args = ["prune", str(folder), "--data", str(tmp_path / "data.txt"), "--text-column", "text", "--task"]
    args += ["causal-lm", "--max-length", "12", "--batch-size", "4", "--kv-cache", "768KiB@8192", "--epochs", "1"]
    result = _invoke([*args, "--depths", "1/2", "-o", str(tmp_path / "shared")])
    assert result.exit_code == 0, result.output
    assert "removed 0 heads" in result.output
    assert "\n| 1/2, 3 KV heads shared in 3 layers | 3 | 0 | " in result.output
    depth = json.loads((tmp_path / "shared" / "frontier" / "plan-1-2-shared.json").read_text())
    assert len(depth["shared_kv_heads"]) == 3 and (tmp_path / "shared" / "frontier" / "plan-1-2.json").exists()
    assert "its KV cache 768.00 KiB at 8,192 tokens (f16), 3 KV heads shared in 3 layers" in result.output
    assert "| shared KV heads | model.layers.0.self_attn: " in (tmp_path / "shared" / "report.md").read_text()
    assert ph.kv_cache_size(ph.load_pruned(tmp_path / "shared"), 8192) == 768 * 1024
    plan = tmp_path / "shared" / "plan.json"
    assert len(json.loads(plan.read_text())["shared_kv_heads"]) == 3
    again = _invoke(["prune", str(folder), "--task", "causal-lm", "--plan", str(plan), "-o", str(tmp_path / "again")])
    assert again.exit_code == 0 and "removed 0 heads, 3 KV heads shared in 3 layers" in again.output, again.output
    assert ph.kv_cache_size(ph.load_pruned(tmp_path / "again"), 8192) == 768 * 1024
    removed = _invoke([*args, "--no-kv-sharing", "-o", str(tmp_path / "removed")])
    assert "removed 6 heads" in removed.output and "shared" not in removed.output


def test_a_loss_bound_prunes_the_deepest_prefix_within_it_and_says_so(tmp_path):
    """`--max-loss` on a tiny Llama: the line names the bound and the rise measured at the depth it chose (with
    `--no-kv-sharing`; by default this Llama's layers fit better shared, which the line says), the report holds
    every rise measured, and a model with no loss on labels (an embedding model) is refused before
    its data (one line, exit 2)."""
    folder = _tiny_llama_folder(tmp_path)
    (tmp_path / "data.txt").write_text("\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))))
    args = ["prune", str(folder), "--data", str(tmp_path / "data.txt"), "--text-column", "text"]
    result = _invoke([*args, "--task", "causal-lm", "--max-loss", "50", "-o", str(tmp_path / "none")])
    assert result.exit_code == 2 and "this data gave none: give more examples" in result.output  # one window
    assert not (tmp_path / "none").exists()
    args += ["--task", "causal-lm", "--max-length", "12", "--batch-size", "4"]
    result = _invoke([*args, "--max-loss", "50", "--no-kv-sharing", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    depth = json.loads((tmp_path / "out" / "report.json").read_text())["meta"]["heldout"]["max_loss"]
    rise = dict((heads, value) for heads, value in depth["rises"])[depth["heads"]]
    assert f"removed {depth['heads']} heads, the most within --max-loss 50% of " in result.output
    assert f"(refitted, before tuning: {100 * rise:+.1f}%)" in result.output and rise <= 0.5
    shared = _invoke([*args, "--max-loss", "50", "-o", str(tmp_path / "shared")])  # this Llama's layers share
    meta = json.loads((tmp_path / "shared" / "report.json").read_text())["meta"]
    assert shared.exit_code == 0 and len(meta["shared_kv_heads"]) == 3, shared.output
    assert "heads, the deepest cut (KV heads shared where that measured better) within --max-loss 50%" in shared.output
    assert "3 KV heads shared in 3 layers" in shared.output
    tiny_models.build("bert").bert.save_pretrained(tmp_path / "bert")
    args = ["--data", "missing.csv", "--task", "feature-extraction", "--max-loss", "3", "-o", "x"]
    result = _invoke(["prune", str(tmp_path / "bert"), *args])
    assert result.exit_code == 2 and "this model has none: give num_heads" in result.output
    assert len(result.output.splitlines()) == 1 and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_a_loss_bound_on_a_classifier_keeps_its_held_out_label_perplexity_within_it(
    tmp_path, fixture_model_path, fixture_data_path
):
    """`--max-loss` on the fine-tuned classifier: the depth is measured on the held-out examples' labels, the line
    says the rise there as the label perplexity's, and it is within the bound."""
    args = ["prune", str(fixture_model_path), "--data", str(fixture_data_path), "--split", "validation[:160]"]
    result = _invoke([*args, "--max-loss", "3", "--epochs", "1", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    heldout = json.loads((tmp_path / "out" / "report.json").read_text())["meta"]["heldout"]
    assert heldout["max_loss"]["heads"] > 0 and heldout["perplexity_change"] <= 0.03
    assert f"held-out label perplexity {100 * heldout['perplexity_change']:+.1f}%" in result.output


def test_a_decoder_pruned_without_data_calibrates_on_text_it_writes(tmp_path):
    """No --data: the decoder writes its calibration text (seeded, so the same model twice), and the line and
    the report say so; a classifier still needs --data."""
    folder = _tiny_llama_folder(tmp_path)
    args = ["prune", str(folder), "--task", "causal-lm", "--num-heads", "2", "--examples", "8", "--max-length", "12"]
    for out in ("a", "b"):
        result = _invoke([*args, "-o", str(tmp_path / out)])
        assert result.exit_code == 0, result.output
        assert "calibrated on 8 sequences of 12 tokens the model wrote itself (seed 0), no --data" in result.output
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert report["meta"]["calibration"].startswith("8 sequences of 12 tokens") and report["meta"]["heldout"]
    a, b = (ph.load_pruned(tmp_path / out).state_dict() for out in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    result = _invoke(["prune", str(folder), "--num-heads", "2", "-o", str(tmp_path / "c")])
    assert result.exit_code == 2 and "--data is required" in result.output and not (tmp_path / "c").exists()
    tiny_models.build("bert").save_pretrained(tmp_path / "bert")
    (tmp_path / "bert.yaml").write_text(f"model: {tmp_path / 'bert'}\nselection: {{num_heads: 2}}\n")
    result = _invoke(["run", str(tmp_path / "bert.yaml"), "-o", str(tmp_path / "d")])
    assert result.exit_code == 2 and "--data is required for task classification" in result.output
    assert not (tmp_path / "d").exists()


def test_a_frontier_reports_every_depth_and_writes_the_budgets(tmp_path):
    """`--depths` on a tiny Llama: one table row per depth (units, heads, perplexity changes with intervals on
    the held-out part and on --eval-data, KV cache, parameters), the same in the report; the model written is
    the budget's depth, the searched order's prefix; each depth's plan is written, and --plan with the same data
    writes that depth recovered. Bad depths are refused before data, in one line."""
    folder = _tiny_llama_folder(tmp_path)
    (tmp_path / "data.txt").write_text("\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))))
    (tmp_path / "other.txt").write_text("\n".join(" ".join(WORDS[::-1][i:]) for i in range(6)))
    args = ["prune", str(folder), "--data", str(tmp_path / "data.txt"), "--text-column", "text", "--task"]
    args += ["causal-lm", "--max-length", "12", "--batch-size", "4", "--sparsity", "0.1667"]
    result = _invoke(
        [*args, "--depths", "1/6,1/3", "--eval-data", str(tmp_path / "other.txt"), "-o", str(tmp_path / "out")]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    frontier = report["meta"]["frontier"]
    assert [(d["units"], d["heads"]) for d in frontier["depths"]] == [(0, 0), (1, 2), (2, 4)]
    assert [d["kv_cache"]["f16"] for d in frontier["depths"]] == [6 * 2**18, 5 * 2**18, 4 * 2**18]  # 256 KiB a group
    assert frontier["second_text"] == str(tmp_path / "other.txt") and frontier["context"] == 8192
    for depth in frontier["depths"]:
        low, high = depth["interval"]
        assert low <= depth["perplexity_change"] <= high and depth["eval_interval"][0] <= depth["eval_change"]
    pruned = ph.load_pruned(tmp_path / "out")
    assert sum(p.numel() for p in pruned.parameters()) >= frontier["depths"][1]["parameters"]  # plus output biases
    assert report["summary"]["heads"]["removed"] == 2
    table = result.output.split("\n\n")[1].splitlines()
    assert f"each depth's plan is in {tmp_path / 'out'}/frontier/: --plan FILE" in result.output
    assert table[0].startswith("| depth | units removed | heads removed | held-out perplexity | perplexity on")
    assert table[2].startswith("| none | 0 | 0 | +0.0% (+0.0 to +0.0) | +0.0% (+0.0 to +0.0) | 1.50 MiB | 36,064 |")
    assert table[3].startswith("| 1/6 | 1 | 2 | ") and table[4].startswith("| 1/3 | 2 | 4 | ")
    assert "| 1.00 MiB | 32,992 |" in table[4] and len(table) == 5
    assert (tmp_path / "out" / "frontier.png").exists() and "| 1/3 | 2 | 4 |" in (
        tmp_path / "out" / "report.md"
    ).read_text()
    for more, message in (
        (["--depths", "1/4"], "selection.depths 1/4: cannot remove exactly sparsity 0.25"),
        (["--depths", "1/3,2"], "give shares of the heads, e.g. '1/6,1/3,1/2'"),
        (["--depths", "1/3", "--no-recovery"], "selection.depths measures each depth on held-out batches"),
    ):
        result = _invoke([*args, *more, "-o", str(tmp_path / "bad")])
        assert result.exit_code == 2 and message in result.output and len(result.output.splitlines()) == 1, more
        assert not (tmp_path / "bad").exists()
    off = ["--eval-data", str(tmp_path / "other.txt"), "--general", "off"]
    result = _invoke([*args, *off, "-o", str(tmp_path / "bad")])
    assert result.exit_code == 2 and "Error: --general off judges on the calibration's text alone" in result.output
    depth = json.loads((tmp_path / "out" / "frontier" / "plan-1-3.json").read_text())
    assert sum(map(len, depth.values())) == 4 and (tmp_path / "out" / "frontier" / "plan-1-6.json").exists()
    plan_args = [a for a in args if a not in ("--sparsity", "0.1667")]
    result = _invoke(
        [*plan_args, "--plan", str(tmp_path / "out" / "frontier" / "plan-1-3.json"), "-o", str(tmp_path / "d")]
    )
    assert result.exit_code == 0, result.output
    assert "removed 4 heads (held-out divergence from the unpruned model" in result.output
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    kept = {s["step"]: s for s in report["recovery"]}["selection"]["kept"]
    assert kept.startswith("given") and report["plan"] == depth


def test_both_demos_refuse_an_existing_output_before_any_work(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kept.txt").write_text("mine")
    for extra in ([], ["--llm"]):
        result = _invoke(["demo", *extra, "-o", str(tmp_path / "out")])
        assert result.exit_code == 2 and "--force" in result.output and len(result.output.splitlines()) == 1, extra
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["kept.txt"]


def test_a_llama_cpp_check_that_cannot_run_is_refused_before_the_run():
    from prune_heads.pipeline.llama_cpp import check_before_and_after

    recipe = load_recipe("demo-smollm2-gguf")
    assert check_before_and_after(recipe).name.endswith(".gguf")
    with pytest.raises(ph.ConfigError, match="data.eval_split"):
        check_before_and_after(load_recipe("demo-smollm2-gguf", ["data.eval_split=null"]))
    with pytest.raises(ph.ConfigError, match="gguf_file"):
        check_before_and_after(load_recipe("fixture-minilm-sentiment"))


def test_a_quantized_gguf_file_loads_in_bfloat16_where_the_device_multiplies_it(monkeypatch):
    from prune_heads.pipeline import loading

    recipe = load_recipe("demo-smollm2-gguf")  # SmolLM2's Q4_1 file
    monkeypatch.setattr(loading, "native_bfloat16", lambda device: True)
    assert loading.default_dtype(recipe) == "bfloat16"
    assert loading.default_dtype(load_recipe("fixture-minilm-sentiment")) is None  # a checkpoint: as stored
    monkeypatch.setattr(loading, "native_bfloat16", lambda device: False)
    assert loading.default_dtype(recipe) is None  # float32, where bfloat16 would be emulated


def test_heal_trains_says_so_and_resumes_only_its_own_run(tmp_path):
    """`--heal` on a tiny Llama: the line gives the tokens healed on and the held-out divergence before and
    after, the report has the healing row and the default checkpoint folder is gone once the model is written;
    `--resume` with nothing to resume, and a budget below one batch, are one line (exit 2) and write nothing."""
    folder = _tiny_llama_folder(tmp_path)
    (tmp_path / "data.txt").write_text("\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))))
    args = ["prune", str(folder), "--data", str(tmp_path / "data.txt"), "--text-column", "text", "--task"]
    args += ["causal-lm", "--max-length", "12", "--batch-size", "4", "--num-heads", "4"]
    result = _invoke([*args, "--heal", "1k", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert re.search(r"; healed on \d+ tokens, held-out divergence [\d.e-]+ -> [\d.e-]+", result.output)
    assert "| healing | " in (tmp_path / "out" / "report.md").read_text()
    assert not (tmp_path / "out.heal").exists()
    result = _invoke([*args, "--heal", "1k", "--resume", "-o", str(tmp_path / "again")])
    assert result.exit_code == 2 and "nothing to resume in" in result.output and not (tmp_path / "again").exists()
    result = _invoke([*args, "--heal", "40", "-o", str(tmp_path / "small")])
    assert result.exit_code == 2 and "below one batch" in result.output and not (tmp_path / "small").exists()
