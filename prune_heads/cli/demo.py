"""`prune-heads demo`: a model the set-up installed, pruned on a shipped text sample (the encoder), or SmolLM2-135M
written as GGUF and checked in llama.cpp before and after (`--llm`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from ..export.gguf import LlamaCheck
from ..recipes import load_recipe
from .options import emit, handle_errors


@click.command()
@click.option("--llm", is_flag=True, help="Prune SmolLM2-135M (GGUF in and out) and check it in llama.cpp instead.")
@click.option("--output", "-o", default=None, help="Where it goes [default: pruned-demo, or pruned-smollm2-demo].")
@click.option("--sparsity", type=float, default=None, help="Share of heads removed [default: 0.5; --llm: 1/3].")
@click.option("--force", is_flag=True, help="Overwrite the output folder.")
@click.option("--json", "as_json", is_flag=True, help="Print the report JSON on stdout.")
@handle_errors
def demo(llm: bool, output: str | None, sparsity: float | None, force: bool, as_json: bool) -> None:
    """Prune a model the set-up installed on a shipped text sample; no hub, no GPU, no labels: the embedded
    all-MiniLM-L6-v2 encoder, or with --llm SmolLM2-135M by a third of its KV groups on the quick path, written
    as GGUF and run in llama.cpp before and after (perplexity, decode speed at 2,048 tokens, file size).

    Example: prune-heads demo --llm
    """
    from ..pipeline import run
    from ..pipeline.llama_cpp import before_and_after, check_before_and_after

    name = "demo-smollm2-gguf" if llm else "demo-minilm-embeddings"
    overrides = [] if sparsity is None else [f"selection.sparsity={sparsity}", "selection.num_heads=null"]
    recipe = load_recipe(name, overrides)
    target = output or recipe.written.path or name
    if llm:
        check_before_and_after(recipe)  # before the run, not after minutes of it
    report = run(recipe, output=target, force=force)
    found = report.to_dict()
    lines = [report.markdown()]
    if llm:
        checks = before_and_after(recipe, Path(target) / "model.gguf", DEMO_CONTEXT)
        found["llama_cpp"] = {"context": DEMO_CONTEXT, "files": [dataclasses.asdict(c) for c in checks]}
        lines += ["", llama_table(checks, DEMO_CONTEXT), "", FULL_PATH.format(target=target)]
    saved = f"Saved the pruned model, report.md, report.json and the plots to {target}/"
    emit(found, as_json, lambda: "\n".join(lines) + "\n" + saved)


DEMO_CONTEXT = 2048  # long enough for the smaller KV cache to show in decode speed, short enough for a demo
FULL_PATH = (
    "The full default path (the plan searched by measured removals, then tuned until the held-out divergence "
    "stops falling; about three times the work):\n"
    "prune-heads run demo-smollm2-gguf --set recovery.search_rounds=null --set recovery.tuning_budget=null "
    "-o {target}-full"
)


def llama_table(checks: list[LlamaCheck], context: int) -> str:
    """The unpruned and the pruned file in llama.cpp side by side, the pruned one's ratio beside each measure."""
    before, after = checks
    mib = 2**20
    rows = [
        ("file, MiB", before.bytes / mib, after.bytes / mib, "{:.1f}"),
        (f"KV cache at {context:,} tokens, MiB", before.kv_cache / mib, after.kv_cache / mib, "{:.0f}"),
        ("perplexity", before.perplexity, after.perplexity, "{:.2f}"),
        ("prompt tokens/s", before.speed.prompt, after.speed.prompt, "{:.0f}"),
        ("decode tokens/s", before.speed.decode, after.speed.decode, "{:.1f}"),
    ]
    lines = ["| in llama.cpp | unpruned | pruned |", "|---|---|---|"]
    lines += [f"| {name} | {form.format(a)} | {form.format(b)} ({b / a:.2f}x) |" for name, a, b, form in rows]
    return "\n".join(lines)
