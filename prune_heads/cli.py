"""The `prune-heads` command line: a thin layer over the public API."""

from __future__ import annotations

import json
import sys

import click

from . import find_attention, load_pruned


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Find and physically remove redundant attention heads from transformers models."""


@main.command()
@click.argument("model_path")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout.")
def inspect(model_path: str, as_json: bool) -> None:
    """Print the attention layers and heads of a checkpoint (a local folder or a hub id).

    Example: prune-heads inspect ./my-pruned-bert
    """
    model = load_pruned(model_path)
    layers = find_attention(model)
    rows = [{"index": l.index, "name": l.name, "kind": l.kind, "family": l.spec.name, "heads": l.num_heads,
             "kv_heads": l.num_kv_heads, "head_dim": l.head_dim, "original_heads": l.original_num_heads,
             "kept": list(l.heads)} for l in layers]
    summary = {"model": model_path, "architecture": type(model).__name__, "parameters": _count(model),
               "heads": sum(r["heads"] for r in rows), "original_heads": sum(r["original_heads"] for r in rows),
               "layers": rows}
    if as_json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    click.echo(f"{model_path}: {summary['architecture']}, {summary['parameters']:,} parameters, "
               f"{summary['heads']} of {summary['original_heads']} heads")
    click.echo(f"{'#':>3}  {'layer':48} {'kind':5} {'family':10} {'heads':>7} {'kv':>4} {'dim':>4}  kept")
    for r in rows:
        kept = ",".join(map(str, r["kept"])) if r["heads"] < r["original_heads"] else "all"
        click.echo(f"{r['index']:>3}  {r['name'][-48:]:48} {r['kind']:5} {r['family']:10} "
                   f"{r['heads']:>3}/{r['original_heads']:<3} {r['kv_heads']:>4} {r['head_dim']:>4}  {kept}")
