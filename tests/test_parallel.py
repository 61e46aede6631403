import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import prune_heads as ph
from prune_heads.cli import main
from prune_heads.runtime.parallel import rank_and_size, sum_across


def test_a_single_process_is_left_alone():
    tensors = [torch.ones(3), torch.arange(4.0).reshape(2, 2)]
    assert rank_and_size() == (0, 1)
    assert sum_across(tensors) is tensors


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
