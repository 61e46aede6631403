"""The benchmark scripts are not run whole in CI (they take minutes to hours): each is imported, so an internal
it uses that was renamed fails here, and their main paths run on tiny random-weight models."""

import dataclasses
import importlib
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import tiny_models as tm
import torch

import prune_heads as ph
from prune_heads.recovery.gated import GatedModel
from prune_heads.recovery.sharing_statistics import sharing_statistics
from prune_heads.scoring.objective import Objective

FOLDER = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.stem for p in FOLDER.glob("*.py"))
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TINY.update(vocab_size=128, head_dim=8)


@pytest.fixture(scope="module")
def bench():
    """Import a benchmark script by name, as the scripts import each other (their folder on the path)."""
    sys.path.insert(0, str(FOLDER))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(FOLDER))


def test_there_are_benchmark_scripts():
    assert len(SCRIPTS) >= 5


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_script_imports(script, bench):
    assert callable(getattr(bench(script), "main", None)) or script in ("common", "baselines", "cost_model")


def test_the_llm_rows_prune_a_tiny_decoder_each_to_its_budget(bench):
    llm = bench("llm")
    data = ph.TaskData("causal-lm", tm.batches("llama", n=4, labels=False), 16)
    for name, method in llm.METHODS.items():
        model = tm.build("llama")
        found = method(model, data, {"num_heads": 4})  # two KV groups, or one attention block
        plan = found.plan if isinstance(found, ph.PruneResult) else found
        assert sum(len(h) for h in plan.values()) == 4, name
        assert sum(layer.num_heads for layer in ph.find_attention(model)) == 8, name


def test_the_cost_and_memory_runs_measure_a_tiny_shape(bench, monkeypatch):
    cost, memory = bench("cost"), bench("memory")
    monkeypatch.setitem(bench("cost_model").CONFIGS, "tiny", ("llama", TINY))
    monkeypatch.setitem(memory.SHAPES, "tiny", TINY)
    found = cost.measure("tiny", "cpu", 4, 2, 16, onload=False, layers=None)
    assert found["removed"] == 2 and not found["stopped"] and found["passes"]["scoring"] > 0
    assert "tiny" in cost.table([found]) and len(cost.row(found)) > 5
    shape, features, seconds, work = cost.refit_seconds("tiny", "cpu", 2)
    assert shape == "tiny" and features == "32 of which 16 kept" and seconds > 0 and work > 0
    measured = memory.measure("default", "tiny", "float32", "cpu", 4, 2, 16, "library")
    assert measured["peak"] > 0 and measured["work"]["total"] > 0 and measured["parameters"] > 0


def test_the_cost_model_counts_a_shapes_proxy_and_predicts_its_terms(bench, monkeypatch):
    model, cost = bench("cost_model"), bench("cost")
    monkeypatch.setitem(model.CONFIGS, "tiny", ("llama", TINY))
    narrow = model.proxy("tiny")
    assert (narrow.hidden_size, narrow.num_attention_heads, narrow.num_key_value_heads) == (16, 4, 2)
    counted = model.count("tiny", 4, 2, 16)
    whole = model.count("tiny", 4, 2, 16, narrow=False)
    assert counted.removed == whole.removed == 2 and counted.refits > 0 and counted.copies > 0
    assert counted.passes["scoring"] == 1.0 and counted.written_rows > 0
    shape = model.structure("tiny")
    one, four = (model.predict(shape, counted, model.H100, n, 2, 16) for n in (1, 4))
    assert four.passes == pytest.approx(one.passes / 4) and four.refits == one.refits > 0
    assert one.summing == 0 < four.summing and not one.onloaded and one.onloading == 0
    small = dataclasses.replace(model.H100, memory=shape.weight_bytes)  # the weights fit, their work does not
    onloaded = model.predict(shape, counted, small, 1, 2, 16)
    assert onloaded.onloaded and onloaded.onloading > 0 and onloaded.writing > one.writing
    assert "| tiny | 8 | whole |" in cost.predicted([counted], model.H100, 2, 16)


def test_the_frontier_cell_records_the_default_path(bench):
    frontier = bench("frontier")
    model = tm.build("llama")
    data = ph.TaskData("causal-lm", tm.batches("llama", n=6, labels=False), 24)
    found = frontier.default(model, data, 2, recovery={"search_rounds": 0})
    assert found["fisher_passes"] > 0 and found["kept"] and found["work"]["total"] > 0


def test_the_coverage_sweep_checks_a_family(bench):
    coverage = bench("coverage")
    verdict, _ = coverage.classify("llama", 120)
    assert verdict == "exact"


def test_the_tables_and_intervals(bench):
    common, quality = bench("common"), bench("quality")
    table = common.markdown_table(["a", "b"], [[1, 0.5]])
    assert table.splitlines()[:2] == ["| a | b |", "|---|---|"] and "0.5" in table
    before = np.array([1, 0, 1, 1] * 25, dtype=float)
    after = np.array([1, 0, 0, 1] * 25, dtype=float)
    found = quality.change(before, after)
    assert found["delta"] == pytest.approx(-25.0) and found["low"] < -25.0 < found["high"] < 0
    assert quality.summary([0.5]) == "0.500" and quality.summary([0.5, 0.7]).startswith("0.600 ±")


def test_the_dtype_check_measures_perplexity_per_text(bench):
    dtype = bench("dtype")
    model = tm.build("llama")
    batches = [dict(b, labels=b["input_ids"]) for b in tm.batches("llama", n=2)]
    found = dtype.perplexities(model, {"a": ph.TaskData("causal-lm", batches, 8)})
    assert set(found) == {"a"} and found["a"].value() > 1


def test_the_sharing_run_cuts_each_layer_of_a_tiny_decoder_both_ways(bench, monkeypatch, capsys):
    sharing = bench("sharing")
    model = tm.build("llama")  # 4 query heads over 2 KV heads
    batches = [{**b, "labels": b["input_ids"]} for b in tm.batches("llama", n=4, labels=False)]
    layers = ph.find_attention(model)
    calibration, heldout, maps = sharing_statistics(model, layers, batches[:2], batches[2:3])
    with GatedModel(model, layers) as gated:
        unpruned = sharing.mean_nll(gated, layers, {}, maps, batches[3:])
        for share in (False, True):
            cut = sharing.best_cut(layers[0], calibration[layers[0].name], heldout[layers[0].name], share)
            assert (len(cut.removed), len(cut.merges)) == ((0, 1) if share else (2, 0))
            after = sharing.mean_nll(gated, layers, {layers[0].name: cut}, maps, batches[3:])
            assert torch.isfinite(torch.tensor(after)) and after != unpruned
        assert sharing.mean_nll(gated, layers, {}, maps, batches[3:]) == unpruned  # the gated model put back
        unlabelled = [{k: v for k, v in b.items() if k != "labels"} for b in batches[:2]]
        targets = [Objective(model).reference(gated(b), b) for b in unlabelled]
        tuning = (unlabelled, targets, batches[2:3])
        tuned = sharing.nlls(gated, layers, {layers[0].name: cut}, maps, {"test": batches[3:]}, tuning)["test"]
        assert math.isfinite(tuned) and tuned != after
        assert sharing.mean_nll(gated, layers, {}, maps, batches[3:]) == unpruned
        monkeypatch.setattr(sharing, "DEPTHS", (1,))
        ways = {}
        for way, share in (("removal", False), ("sharing", True)):
            cuts = {l.name: sharing.best_cut(l, calibration[l.name], heldout[l.name], share) for l in layers}
            ways[way] = {n: dataclasses.replace(c, nll=0.1 * i) for i, (n, c) in enumerate(cuts.items())}
        ways["better of the two"] = ways["sharing"]
        tests = {"movie": batches[3:], "tweets": batches[2:3]}
        sharing.print_tables(gated, layers, ways, maps, tests, 2, tuning)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "%" in line]
    assert len(rows) == 3 and "2 (1 layers, 1 shared)" in rows[1]
