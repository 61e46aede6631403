"""See your heads: `analyze` measures where a model's heads matter, which repeat each other, what each does and
what a cut would cost (`records` holds what it finds, `sums` what its pass adds up, `derived` what the sums say);
`page` draws it as one self-contained HTML page a person reads."""

from .analyze import analyze
from .records import Analysis, CutCost, LayerAnalysis, Pair

__all__ = ["analyze", "Analysis", "CutCost", "LayerAnalysis", "Pair"]
