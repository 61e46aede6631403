import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tiny_models as tm
import torch

import prune_heads as ph

# Runs in a venv that sees this one's packages but not prune_heads (its editable install is a .pth file,
# which only site directories process): it loads every saved family with plain transformers.
LOADER = """
import importlib.util, json, sys, torch, transformers
assert importlib.util.find_spec("prune_heads") is None, "prune_heads must not be importable here"
sys.path.insert(0, sys.argv[2])
import tiny_models as tm
results = {}
for folder in sorted(p for p in __import__("pathlib").Path(sys.argv[1]).iterdir() if p.is_dir()):
    config = json.loads((folder / "config.json").read_text())
    auto = getattr(transformers, sorted(config["auto_map"])[0])
    model = auto.from_pretrained(folder, trust_remote_code=True, attn_implementation="eager").eval()
    inputs = tm.make_inputs(folder.name)
    with torch.no_grad():
        out = {"output": tm.main_output(model(**inputs)), "class": type(model).__module__,
               "params": sum(p.numel() for p in model.parameters())}
        if tm.FAMILIES[folder.name][3] == "decoder":
            out["generated"] = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    results[folder.name] = out
torch.save(results, sys.argv[3])
"""


def _venv_without_prune_heads(root: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next(root.glob("lib/python*/site-packages"))
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return root / "bin" / "python"


@pytest.mark.slow
def test_standalone_checkpoints_load_without_prune_heads(tmp_path):
    expected = {}
    for name in tm.FAMILIES:
        model, inputs = tm.build(name), tm.make_inputs(name)
        ph.prune(model, tm.uneven_plan(ph.find_attention(model)))
        ph.save_pruned(model, tmp_path / "models" / name, standalone=True)
        with torch.no_grad():
            expected[name] = {
                "output": tm.main_output(model(**inputs)),
                "params": sum(p.numel() for p in model.parameters()),
            }
            if tm.FAMILIES[name][3] == "decoder":
                expected[name]["generated"] = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    python = _venv_without_prune_heads(tmp_path / "venv")
    env = {"HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [str(python), "-c", LOADER, str(tmp_path / "models"), str(Path(__file__).parent), str(tmp_path / "out.pt")],
        check=True,
        cwd=tmp_path,
        env=env,
    )
    loaded = torch.load(tmp_path / "out.pt")
    assert set(loaded) == set(expected)
    for name, want in expected.items():
        got = loaded[name]
        assert got["class"].endswith("modeling_prune_heads"), name  # loaded by the checkpoint's own code
        assert got["params"] == want["params"], name
        assert torch.equal(got["output"], want["output"]), name
        if "generated" in want:
            assert torch.equal(got["generated"], want["generated"]), name


def test_standalone_is_skipped_where_nothing_was_pruned_or_the_config_is_stock(tmp_path):
    model = tm.build("llama")
    ph.prune(model, {i: [0, 1] for i in range(3)})  # uniform: a stock config, no code needed
    ph.save_pruned(model, tmp_path / "stock", standalone=True)
    assert "auto_map" not in json.loads((tmp_path / "stock" / "config.json").read_text())
    assert not list((tmp_path / "stock").glob("*.py"))
    ph.save_pruned(tm.build("bert"), tmp_path / "plain", standalone=True)
    assert not list((tmp_path / "plain").glob("*.py"))
