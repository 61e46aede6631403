import json

import torch

import prune_heads as ph
from prune_heads.evaluation.report import compare


def measurement(acc, latency, flops, heads):
    return {
        "metrics": {"accuracy": acc, "examples": 100},
        "speed": {
            "latency_ms": latency,
            "latency_p90_ms": latency * 1.1,
            "examples_per_s": 8000 / latency,
            "tokens_per_s": 1e6 / latency,
            "parameters": 1000 + 10 * sum(heads.values()),
            "flops": flops,
            "peak_memory_bytes": 2**20,
            "settings": {"batch_size": 8, "seq_len": 128},
        },
        "heads": heads,
    }


def test_report_summary_json_markdown_and_plots(tmp_path):
    before = measurement(0.85, 200.0, 100e9, {"l.0": 12, "l.1": 12})
    after = measurement(0.84, 160.0, 80e9, {"l.0": 6, "l.1": 9})
    scores = ph.HeadScores(
        "gradient",
        10,
        {"l.0": torch.rand(12), "l.1": torch.rand(12)},
        {"l.0": tuple(range(12)), "l.1": tuple(range(12))},
        {"l.0": 1, "l.1": 1},
        {"l.0": 12, "l.1": 12},
    )
    history = [
        {"step": 0, "heads_removed": 0, "loss": 0.3, "accuracy": 0.85},
        {"step": 1, "heads_removed": 9, "loss": 0.35, "accuracy": 0.84},
    ]
    report = compare(
        before,
        after,
        plan={"l.0": [0, 1, 2, 3, 4, 5], "l.1": [0, 1, 2]},
        scores=scores,
        history=history,
        meta={"model": "m"},
    )
    summary = report.summary()
    assert abs(summary["metrics"]["accuracy"]["delta"] + 0.01) < 1e-12
    assert summary["speed"]["speedup"] == 1.25 and summary["speed"]["flops_ceiling"] == 1.25
    assert summary["speed"]["fraction_of_ceiling"] == 1.0
    assert summary["heads"] == {"before": 24, "after": 15, "removed": 9}
    paths = report.write(tmp_path)
    assert set(paths) == {"json", "markdown", "heatmap", "heads", "curve"}
    for key in ("heatmap", "heads", "curve"):
        assert paths[key].read_bytes()[:4] == b"\x89PNG"
    data = json.loads(paths["json"].read_text())
    assert data["summary"]["heads"]["removed"] == 9 and data["plan"]["l.1"] == [0, 1, 2]
    text = paths["markdown"].read_text()
    assert "| accuracy | 0.8500 | 0.8400 | -0.0100 |" in text and "1.25x faster" in text
    assert "| l.0 | 6 / 12 |" in text


def test_changes_are_shown_with_their_interval_and_lm_eval_errors():
    before = {"metrics": {"accuracy": 0.85, "task:acc": 0.6, "task:acc_stderr": 0.02}, "heads": {"l": 4}}
    after = {"metrics": {"accuracy": 0.80, "task:acc": 0.61, "task:acc_stderr": 0.021}, "heads": {"l": 2}}
    changes = {
        "accuracy": {
            "delta": -0.05,
            "low": -0.08,
            "high": -0.02,
            "level": 0.95,
            "examples": 500,
            "p_value": 0.001,
            "noise": False,
        },
        "task:acc": {"delta": 0.01, "low": -0.03, "high": 0.05, "level": 0.95, "examples": 400, "noise": True},
    }
    report = compare(before, after, changes=changes)
    metrics = report.summary()["metrics"]
    assert "task:acc_stderr" not in metrics and metrics["task:acc"]["stderr_after"] == 0.021
    text = report.markdown()
    assert (
        "| accuracy | 0.8500 | 0.8000 | -0.0500 (95% CI -0.0800 to -0.0200; McNemar p = 0.001): real, lower |" in text
    )
    assert (
        "| task:acc | 0.6000 ± 0.0200 | 0.6100 ± 0.0210 | +0.0100 (95% CI -0.0300 to +0.0500): within noise |" in text
    )
    assert "± is lm-eval's standard error" in text


def test_the_work_line_says_what_onloading_moved_against_the_offloaded_weights():
    work = {"calibration_pass": 1e12, "scoring": 1e12, "total": 1e12}
    meta = {"model": "m", "work": work}
    recovery = [{"step": "selection", "tried": {"plan": 0.1}, "kept": "plan", "seconds": 1.0}]
    plain = compare(
        measurement(0.8, 10.0, 1e9, {"l": 2}), measurement(0.8, 9.0, 1e9, {"l": 1}), recovery=recovery, meta=meta
    )
    assert "Work, counted in FLOPs" in plain.markdown() and "Onloading" not in plain.markdown()
    meta["work"] = {**work, "moved_bytes": 3 * 2**30, "offloaded_bytes": 2**30}
    onloaded = compare(
        measurement(0.8, 10.0, 1e9, {"l": 2}), measurement(0.8, 9.0, 1e9, {"l": 1}), recovery=recovery, meta=meta
    )
    assert "Onloading moved 3.00 GiB to the device, 3.0 times the offloaded weights' 1.00 GiB." in onloaded.markdown()
