"""`prune-heads analyze`: the heads page (which heads matter, which repeat each other, what each does and what a
cut would cost) and its JSON for a model and data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .options import data_options, emit, handle_errors, make_recipe


@click.command()
@click.argument("model")
@data_options
@click.option(
    "--output",
    "-o",
    default="head-analysis",
    show_default=True,
    help="Folder for analysis.html (the page) and analysis.json.",
)
@click.option("--label-free", is_flag=True, help="Ignore labels: measure against the unpruned model's outputs.")
@click.option("--force", is_flag=True, help="Overwrite the output folder.")
@handle_errors
def analyze(model: str, output: str, label_free: bool, force: bool, **opts: Any) -> None:
    """See the heads: importance with intervals, near-duplicate heads and KV heads, what each head attends to
    and what removing the least important would cost; one HTML page and its JSON.

    Example: prune-heads analyze ./model --data ./reviews.txt --split train -o heads
    """
    from ..evaluation.analysis import analyze as analyze_heads
    from ..evaluation.analysis.page import write_page
    from ..export.persistence import ensure_free, replace_folder
    from ..pipeline import load_model, load_processor, task_data

    recipe = make_recipe(model, opts)
    ensure_free(Path(output), force)  # before any work
    loaded = load_model(recipe)
    data = task_data(recipe, loaded, load_processor(recipe), opts["split"], opts["examples"])
    found = analyze_heads(loaded, data.without_labels() if label_free else data, seed=opts["seed"])

    def write(tmp: Path) -> None:
        write_page(found, tmp)

    replace_folder(Path(output), force, write)
    emit(
        found.to_dict(),
        opts["as_json"],
        lambda: (
            f"analysed {sum(len(layer.heads) for layer in found.layers)} heads on {found.examples} examples "
            f"({found.passes:.2f} fisher passes): {len(found.duplicates)} near-duplicate pairs, ranking agreement "
            f"{found.rank_agreement:.2f}; wrote {output}/analysis.html and {output}/analysis.json"
        ),
    )
