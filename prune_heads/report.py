"""Reports: before/after comparison as JSON and Markdown, and PNG plots a person can read."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scoring import HeadScores


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _short(name: str) -> str:
    parts = name.split(".")
    digits = [p for p in parts if p.isdigit()]
    stack = next((p for p in parts if p in ("encoder", "decoder")), "")
    return f"{stack[:3]} {'.'.join(digits)} {parts[-1]}".strip() if digits else name[-24:]


def heatmap(scores: "HeadScores", path: Path, removed: dict[str, list[int]], title: str | None = None) -> Path:
    """Layers x heads importance heatmap; removed heads crossed out, absent heads left blank."""
    plt = _pyplot()
    grid = scores.matrix().numpy()
    rows, cols = grid.shape
    fig, ax = plt.subplots(figsize=(max(5, 0.45 * cols + 2.5), max(2.5, 0.32 * rows + 1.5)))
    image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label=f"importance ({scores.method})")
    for row, name in enumerate(scores.layers):
        for head in removed.get(name, []):
            ax.plot(head, row, marker="x", color="red", markersize=8, markeredgewidth=2)
    ax.set_xticks(range(cols))
    ax.set_yticks(range(rows))
    ax.set_yticklabels([_short(n) for n in scores.layers], fontsize=7)
    ax.set_xlabel("head")
    ax.set_ylabel("attention layer")
    kept = sum(len(h) for h in scores.heads.values()) - sum(len(h) for h in removed.values())
    ax.set_title(title or f"Head importance ({scores.method}, {scores.num_examples} examples); "
                          f"x = removed, {kept} heads kept", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
