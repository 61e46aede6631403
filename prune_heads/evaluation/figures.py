"""What every figure the package draws starts from: matplotlib without a display, and short layer names."""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), imported when a figure is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def short_name(name: str) -> str:
    """A layer's name short enough for an axis: its stack, block numbers and last part."""
    parts = name.split(".")
    digits = [p for p in parts if p.isdigit()]
    stack = next((p for p in parts if p in ("encoder", "decoder")), "")
    return f"{stack[:3]} {'.'.join(digits)} {parts[-1]}".strip() if digits else name[-24:]
