"""Evaluation: what pruning changed, and whether it is real.

`task` (task metrics: accuracy, perplexity, embedding fidelity and task accuracy), `lm_eval`
(lm-evaluation-harness on the model object), `speed` (latency, throughput, FLOPs, memory, generation),
`confidence` (paired bootstrap intervals and McNemar), `report` (the before/after report a person reads
and the JSON a pipeline consumes), `analysis/` (`analyze`: which heads matter, which repeat each other, what
each does, drawn as one HTML page) and `figures` (what every plot starts from); `metrics/` holds the metric
scripts shipped for offline use.
"""

from .analysis import Analysis, analyze
from .lm_eval import LmEvalConfig, LmEvalError, lm_eval
from .report import Report, compare
from .speed import benchmark, benchmark_pair
from .task import evaluate_task

__all__ = [
    "analyze",
    "Analysis",
    "benchmark",
    "benchmark_pair",
    "compare",
    "evaluate_task",
    "lm_eval",
    "LmEvalConfig",
    "LmEvalError",
    "Report",
]
