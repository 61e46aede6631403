import json
import shutil

import pytest
import tiny_models as tm
import torch
from click.testing import CliRunner

import prune_heads as ph
import prune_heads.export.hub as hub
from prune_heads.cli import main


class LocalHub:
    """Stands in for huggingface_hub.HfApi: repos are folders under `root`, commits write their files."""

    def __init__(self, root):
        self.root, self.commits = root, []

    def create_repo(self, repo_id, private=None, exist_ok=False):
        (self.root / repo_id).mkdir(parents=True, exist_ok=exist_ok)

    def create_commit(self, repo_id, operations, commit_message):
        for op in operations:
            target = self.root / repo_id / op.path_in_repo
            target.parent.mkdir(parents=True, exist_ok=True)
            with op.as_file() as f:
                target.write_bytes(f.read())
        self.commits.append((repo_id, commit_message, sorted(op.path_in_repo for op in operations)))
        return f"local://{repo_id}"


def test_push_a_module_with_standalone_code_and_a_card(tmp_path):
    model, inputs = tm.build("bert"), tm.make_inputs("bert")
    ph.prune(model, tm.uneven_plan(ph.find_attention(model)))
    api = LocalHub(tmp_path / "hub")
    assert (
        ph.push_pruned(model, "me/tiny-pruned", base_model="google-bert/bert-base-uncased", standalone=True, api=api)
        == "local://me/tiny-pruned"
    )
    assert len(api.commits) == 1  # one commit: weights, config, code and card together
    repo = tmp_path / "hub" / "me" / "tiny-pruned"
    card = (repo / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n") and "base_model: google-bert/bert-base-uncased" in card
    assert "trust_remote_code=True" in card and "| bert.encoder.layer.1.attention | 0 / 4 | [0, 1, 2, 3] |" in card
    assert (repo / "modeling_prune_heads.py").exists()
    loaded = ph.load_pruned(repo, attn_implementation="eager")
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)


def test_push_command_sends_a_run_folder_with_its_report(fixture_run, monkeypatch, tmp_path):
    out, _ = fixture_run
    api = LocalHub(tmp_path / "hub")
    monkeypatch.setattr(hub, "HfApi", lambda token=None: api)
    result = CliRunner().invoke(main, ["push", str(out), "me/minilm-pruned"])
    assert result.exit_code == 0, result.output
    assert "pushed" in result.output and "local://me/minilm-pruned" in result.output
    repo = tmp_path / "hub" / "me" / "minilm-pruned"
    card = (repo / "README.md").read_text()
    report = json.loads((out / "report.json").read_text())
    accuracy = report["after"]["metrics"]["accuracy"]
    assert "base_model:" not in card  # a local path is no hub id
    assert "36 of 72 attention heads removed" in card and "| accuracy |" in card and f"{accuracy:.4f}" in card
    assert "Method: fisher scores" in card and "![heads kept per layer](heads_per_layer.png)" in card
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy)
    assert sorted(p.name for p in copy.iterdir()) == sorted([*(p.name for p in out.iterdir()), "README.md"])
    assert sum(l.num_heads for l in ph.find_attention(ph.load_pruned(copy))) == 36


def test_card_for_a_stock_uniform_checkpoint(tmp_path):
    model = tm.build("llama")
    ph.prune(model, {i: [0, 1] for i in range(3)})
    ph.save_pruned(model, tmp_path / "m")
    card = ph.model_card(tmp_path / "m", base_model="meta-llama/Llama-3.2-1B")
    assert "A stock config" in card and "6 of 12 attention heads removed" in card
    with pytest.raises(FileNotFoundError):
        ph.model_card(tmp_path / "missing")
