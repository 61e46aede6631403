"""The analysis as one self-contained HTML page (images embedded as PNG data, readable offline): importance and
its intervals, the per-layer redundancy matrices, the behaviour maps and the cost curve, each with a sentence on
how to read it."""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..figures import pyplot, short_name
from .derived import DUPLICATE
from .records import Analysis, LayerAnalysis, Matrix
from .sums import BEHAVIOURS

DPI = 90
Removed = dict[str, list[int]]


def _png(draw: Callable) -> str:
    """A figure drawn by `draw(plt)` (which returns the figure) as a data URL."""
    plt = pyplot()
    figure = draw(plt)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    plt.close(figure)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _grid(analysis: Analysis, field: str) -> np.ndarray:
    """[layers, original heads] of a per-head field, NaN where a head is absent."""
    width = max(max(layer.heads) + 1 for layer in analysis.layers)
    grid = np.full((len(analysis.layers), width), np.nan)
    for row, layer in enumerate(analysis.layers):
        values = getattr(layer, field)
        if values is not None:
            grid[row, list(layer.heads)] = values
    return grid


def _mark(ax, analysis: Analysis, removed: Removed) -> None:
    for row, layer in enumerate(analysis.layers):
        for head in removed.get(layer.name, []):
            ax.plot(head, row, marker="x", color="red", markersize=7, markeredgewidth=2)


def _draw_map(figure, ax, analysis: Analysis, field: str, removed: Removed, log: bool = False, unit: bool = False):
    """One layers x heads map of a per-head field on `ax` (log10, or fixed 0 to 1 for a share)."""
    grid = _grid(analysis, field)
    shown = np.log10(np.maximum(grid, 1e-30)) if log else grid
    image = ax.imshow(shown, aspect="auto", cmap="viridis", interpolation="nearest", vmin=0 if unit else None,
                      vmax=1 if unit else None)  # fmt: skip
    figure.colorbar(image, ax=ax, shrink=0.8)
    _mark(ax, analysis, removed)
    ax.set_yticks(range(grid.shape[0]), [short_name(layer.name) for layer in analysis.layers], fontsize=6)
    ax.set_xticks(range(0, grid.shape[1], max(1, grid.shape[1] // 8)))
    ax.set_xlabel("head", fontsize=8)
    ax.set_title(("log10 " if log else "") + field, fontsize=9)


def _importance(analysis: Analysis, removed: Removed) -> str:
    def draw(plt):
        rows, cols = _grid(analysis, "importance").shape
        figure, ax = plt.subplots(figsize=(max(4, 0.4 * cols + 2.5), max(2.5, 0.25 * rows + 1.5)))
        _draw_map(figure, ax, analysis, "importance", removed, log=True)
        figure.tight_layout()
        return figure

    return _png(draw)


def _behaviour(analysis: Analysis, removed: Removed) -> str:
    def draw(plt):
        rows, cols = _grid(analysis, "entropy").shape
        width = max(2.6, 0.22 * cols + 1.6)
        figure, axes = plt.subplots(1, len(BEHAVIOURS), figsize=(width * len(BEHAVIOURS), max(2.5, 0.22 * rows + 1.5)))
        for ax, field in zip(axes, BEHAVIOURS):
            _draw_map(figure, ax, analysis, field, removed, unit=field in ("first", "previous", "same"))
        figure.tight_layout()
        return figure

    return _png(draw)


def _intervals(analysis: Analysis, removed: Removed) -> str:
    def draw(plt):
        rows = [
            (value, low, high, head in removed.get(layer.name, []))
            for layer in analysis.layers
            for value, low, high, head in zip(layer.importance, layer.low, layer.high, layer.heads)
        ]
        rows.sort(key=lambda row: row[0])
        value, low, high, gone = (np.array(column) for column in zip(*rows))
        floor = max(value[value > 0].min() / 10, 1e-30) if (value > 0).any() else 1e-30
        figure, ax = plt.subplots(figsize=(8, 3))
        x = np.arange(len(value))
        error = [np.maximum(value - low, 0), np.maximum(high - value, 0)]
        ax.errorbar(x, np.maximum(value, floor), yerr=error, fmt=".", color="tab:blue", ecolor="0.7", markersize=3)
        ax.plot(x[gone], np.maximum(value[gone], floor), "x", color="red", label="removed")
        ax.set_yscale("log")
        ax.set_xlabel("heads, least important first")
        ax.set_ylabel(f"importance ({analysis.method})")
        if gone.any():
            ax.legend(fontsize=7)
        figure.tight_layout()
        return figure

    return _png(draw)


def kv_shared(layer: LayerAnalysis) -> np.ndarray | None:
    """[i][j]: the share of KV head i's keys and values that KV head j's explain (the smaller of the two; the
    values' alone where keys cannot be mapped), None outside grouped-query layers."""
    if layer.value_share is None:
        return None
    values = np.array(layer.value_share)
    return values if layer.key_share is None else np.minimum(values, np.array(layer.key_share))


def _matrices(analysis: Analysis, of: Callable[[LayerAnalysis], Any], title: str) -> str | None:
    layers = [layer for layer in analysis.layers if of(layer) is not None and len(layer.heads) > 1]
    if not layers:
        return None
    signed = of is _similarity

    def draw(plt):
        columns = min(6, len(layers))
        lines = math.ceil(len(layers) / columns)
        figure, axes = plt.subplots(lines, columns, figsize=(1.7 * columns + 1, 1.7 * lines + 0.6), squeeze=False)
        for ax, layer in zip(axes.flat, layers):
            image = ax.imshow(np.array(of(layer)), cmap="RdBu_r" if signed else "magma",
                              vmin=-1 if signed else 0, vmax=1, interpolation="nearest")  # fmt: skip
            ax.set_title(short_name(layer.name), fontsize=6)
            labels = layer.heads if signed else layer.kv_heads
            ax.set_xticks(range(len(labels)), labels, fontsize=5)
            ax.set_yticks(range(len(labels)), labels, fontsize=5)
        for ax in list(axes.flat)[len(layers) :]:
            ax.axis("off")
        figure.suptitle(title, fontsize=9)
        figure.colorbar(image, ax=axes, shrink=0.6)
        return figure

    return _png(draw)


def _similarity(layer: LayerAnalysis) -> Matrix:
    return layer.similarity


def _costs(analysis: Analysis) -> str | None:
    if not analysis.costs:
        return None

    def draw(plt):
        figure, ax = plt.subplots(figsize=(5, 3))
        x = [cost.heads for cost in analysis.costs]
        y = [cost.divergence for cost in analysis.costs]
        error = [
            [max(c.divergence - c.low, 0) for c in analysis.costs],
            [c.high - c.divergence for c in analysis.costs],
        ]
        ax.errorbar(x, y, yerr=error, fmt="o-", capsize=3)
        ax.set_xlabel(f"query heads removed (least important {analysis.unit}s first)")
        ax.set_ylabel("divergence from the unpruned model")
        figure.tight_layout()
        return figure

    return _png(draw)


def _pairs_table(analysis: Analysis, limit: int = 30) -> str:
    if not analysis.duplicates:
        return f"<p>No pair explains {DUPLICATE:.0%} or more of the other: no head here repeats another.</p>"
    rows = sorted(analysis.duplicates, key=lambda pair: -abs(pair.similarity))[:limit]
    body = "".join(
        f"<tr><td>{html.escape(p.layer)}</td><td>{p.kind}</td><td>{p.a}</td><td>{p.b}</td>"
        f"<td>{p.similarity:+.3f}</td></tr>"
        for p in rows
    )
    more = (
        f"<p>and {len(analysis.duplicates) - limit} more in the JSON.</p>" if len(analysis.duplicates) > limit else ""
    )
    head = "<tr><th>layer</th><th>kind</th><th>a</th><th>b</th><th>similarity</th></tr>"
    return f"<table>{head}{body}</table>{more}"


def _figure(title: str, image: str | None, how: str) -> str:
    if image is None:
        return ""
    return f'<section><h2>{title}</h2><p class="how">{how}</p><img alt="{title}" src="{image}"></section>'


STYLE = (
    "body{font-family:sans-serif;max-width:70em;margin:2em auto;padding:0 1em;color:#222}"
    "img{max-width:100%;border:1px solid #ddd}.how{color:#555}table{border-collapse:collapse}"
    "td,th{border:1px solid #ccc;padding:2px 8px;font-size:90%}"
)


def _sections(analysis: Analysis, removed: Removed) -> list[str]:
    return [
        _figure(
            "Importance",
            _importance(analysis, removed),
            f"Each cell is a head, its {analysis.method} score (log scale, brighter matters more); red crosses "
            "are the heads removed.",
        ),  # fmt: skip
        _figure(
            "How sure each score is",
            _intervals(analysis, removed),
            "Every head, least important first, with its 95% interval over resampled batches: overlapping "
            "bars are heads the data cannot order.",
        ),  # fmt: skip
        _figure(
            "Redundancy within each layer",
            _matrices(analysis, _similarity, "cosine of what heads write"),
            "Cosine, over the same tokens, of what each pair of heads writes through the output projection: "
            "dark red off the diagonal is a pair writing nearly the same thing.",
        ),  # fmt: skip
        _figure(
            "KV heads that could be shared",
            _matrices(analysis, kv_shared, "share of the row's keys and values the column's explain"),
            "Row i, column j: the share of KV head i's keys (by a scale per rotary pair) and values (by a linear "
            "map) that KV head j's explain, the smaller of the two; bright off the diagonal, the layer could keep "
            "one of the two.",
        ),  # fmt: skip
        _figure(
            "What each head does",
            _behaviour(analysis, removed),
            "Per head, over the query tokens: the attention's entropy (nats; low, it looks at few tokens), the "
            "mean distance to the keys it attends (tokens), and its share of attention on the first token "
            "(near 1, an attention sink, which writes little), on the previous token and on itself.",
        ),  # fmt: skip
        _figure(
            "What a cut would cost",
            _costs(analysis),
            f"The divergence from the unpruned model, measured with the least important {analysis.unit}s "
            "removed and nothing recovered, with its 95% interval: where it bends up, the cut starts to hurt.",
        ),  # fmt: skip
        "<section><h2>Near-duplicate pairs</h2>" + _pairs_table(analysis) + "</section>",
    ]


def page(analysis: Analysis, removed: Removed | None = None) -> str:
    """The page's HTML; `removed` ({layer: original heads}) marks what a pruning run removed."""
    removed = removed or {}
    heads = sum(len(layer.heads) for layer in analysis.layers)
    gone = sum(len(v) for v in removed.values())
    summary = (
        f"{html.escape(analysis.model)}: {heads} heads in {len(analysis.layers)} attention layers, measured on "
        f"{analysis.examples} examples in {analysis.batches} batches ({analysis.passes:.2f} fisher passes). "
        f"The ranking's agreement over resampled batches: {analysis.rank_agreement:.2f} (Spearman; 1 = stable). "
        f"{len(analysis.duplicates)} near-duplicate pairs." + (f" {gone} heads removed (red crosses)." if gone else "")
    )
    body = "".join(_sections(analysis, removed))
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Heads of {html.escape(analysis.model)}'
        f"</title><style>{STYLE}</style></head><body><h1>Attention heads</h1><p>{summary}</p>{body}</body></html>"
    )


def write_page(analysis: Analysis, folder: Path, removed: Removed | None = None) -> Path:
    """Write analysis.html and analysis.json into `folder`; the page's path."""
    analysis.save(folder / "analysis.json")
    path = folder / "analysis.html"
    path.write_text(page(analysis, removed))
    return path
