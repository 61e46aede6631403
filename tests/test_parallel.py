import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import prune_heads as ph
from prune_heads.cli import main
from prune_heads.runtime import parallel
from prune_heads.runtime.parallel import rank_and_size, sum_across


def test_a_single_process_is_left_alone():
    tensors = [torch.ones(3), torch.arange(4.0).reshape(2, 2)]
    assert rank_and_size() == (0, 1)
    assert sum_across(tensors) is tensors


def test_tensors_are_summed_across_processes_in_runs_of_at_most_a_chunk(monkeypatch):
    monkeypatch.setattr(parallel, "CHUNK", 10)
    tensors = [torch.zeros(n) for n in (4, 5, 12, 3, 7, 1)]
    assert [[t.numel() for t in run] for run in parallel._chunks(tensors)] == [[4, 5], [12], [3, 7], [1]]


# 72 examples in batches of 16: five batches, shared 3 / 2 between the two processes
@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--method", "fisher"], ["--method", "gradient", "--label-free"]])
def test_two_gloo_processes_give_the_single_process_scores_and_plans(
    extra, fixture_model_path, fixture_data_path, tmp_path
):
    common = [
        "score",
        str(fixture_model_path),
        "--data",
        str(fixture_data_path),
        "--split",
        "validation",
        "--examples",
        "72",
        "--batch-size",
        "16",
        *extra,
    ]
    result = CliRunner().invoke(main, [*common, "-o", str(tmp_path / "one")])
    assert result.exit_code == 0, result.output
    subprocess.run(
        [sys.executable, "-m", "prune_heads.cli", *common, "-o", str(tmp_path / "two"), "--processes", "2"],
        check=True,
        cwd=tmp_path,
    )
    one, two = (ph.HeadScores.load(tmp_path / name / "scores.json") for name in ("one", "two"))
    assert one.num_examples == two.num_examples == 72
    for name in one.layers:
        torch.testing.assert_close(two.scores[name], one.scores[name], rtol=1e-5, atol=1e-12)
    for sparsity in (0.25, 0.5, 0.75):  # and the same plans, the plain ranking and the Fisher blocks
        assert ph.select_heads(two, sparsity=sparsity) == ph.select_heads(one, sparsity=sparsity)
        if extra[1] == "fisher":
            assert ph.plan_with_interactions(two, sparsity=sparsity) == ph.plan_with_interactions(
                one, sparsity=sparsity
            )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # one writer, nothing half-written


SCRIPT = str(Path(__file__).parent / "parallel_prune.py")
LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517"]
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "bert"])
def test_two_gloo_processes_prune_as_one_process_does(name, tmp_path):
    """The whole default path on 2 processes (each its rows of every batch, the statistics, held-out values and
    tuning gradients joined) gives one process's plan, recovery decisions and weights within float rounding;
    the text a language model writes (each process its share of the rows) is one process's."""
    subprocess.run([sys.executable, SCRIPT, name, str(tmp_path / "one.pt")], check=True)
    subprocess.run([*LAUNCH, SCRIPT, name, str(tmp_path / "two.pt")], check=True, env=ONE_THREAD)
    one, two = (torch.load(tmp_path / f"{n}.pt", weights_only=False) for n in ("one", "two"))
    assert two["plan"] == one["plan"]
    assert len(two["written"]) == len(one["written"]) == (3 if name == "llama" else 0)
    assert all(torch.equal(a, b) for a, b in zip(two["written"], one["written"]))
    found, expected = _flat(two["recovery"]), _flat(one["recovery"])
    assert {k: v for k, v in found.items() if not isinstance(v, float)} == {
        k: v for k, v in expected.items() if not isinstance(v, float)
    }
    floats = [k for k, v in expected.items() if isinstance(v, float)]
    assert [found[k] for k in floats] == pytest.approx(
        [expected[k] for k in floats], rel=1e-2, abs=1e-9
    )  # Adam amplifies rounding
    assert two["weights"].keys() == one["weights"].keys()
    for key, value in one["weights"].items():
        torch.testing.assert_close(two["weights"][key], value, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_two_gloo_processes_heal_as_one_process_does(tmp_path):
    """A heal on 2 processes (each half of every batch, the Trainer's gradients joined through accelerate)
    trains on the budget's tokens once, not once per process, and ends within float rounding of one process's
    weights."""
    subprocess.run([sys.executable, SCRIPT, "llama", str(tmp_path / "one.pt"), "40", "400"], check=True)
    two = [*LAUNCH, SCRIPT, "llama", str(tmp_path / "two.pt"), "40", "400"]
    subprocess.run(two, check=True, env=ONE_THREAD)
    one, two = (torch.load(tmp_path / f"{n}.pt", weights_only=False) for n in ("one", "two"))
    healed = [next(e for e in found["recovery"] if e["step"] == "healing") for found in (one, two)]
    assert healed[0]["tokens"] == healed[1]["tokens"] and healed[0]["kept"] == healed[1]["kept"]
    for key, value in one["weights"].items():
        torch.testing.assert_close(two["weights"][key], value, rtol=1e-2, atol=1e-3)


def _flat(found, path: str = "") -> dict:
    """The report's recovery steps as {path: value}, their timings left out (floats compare approximately)."""
    if isinstance(found, dict | list):
        items = found.items() if isinstance(found, dict) else enumerate(found)
        return {k: v for key, item in items if key != "seconds" for k, v in _flat(item, f"{path}/{key}").items()}
    return {path: found}


@pytest.mark.slow
def test_more_processes_than_calibration_examples_are_refused_before_scoring(tmp_path):
    done = subprocess.run(
        [*LAUNCH, SCRIPT, "llama", str(tmp_path / "two.pt"), "1"], env=ONE_THREAD, capture_output=True
    )
    assert done.returncode != 0 and not (tmp_path / "two.pt").exists()
    assert b"2 data-parallel processes share 1 calibration examples: run at most 1 processes" in done.stderr


def test_more_processes_than_devices_are_refused_in_one_line(tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "prune",
            "some/model",
            "--data",
            "some/data",
            "--num-heads",
            "2",
            "--processes",
            "100000",
            "-o",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 2 and "--processes 100000 is more than the" in result.output
    assert list(tmp_path.iterdir()) == []
