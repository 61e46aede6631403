"""The whole run behind `prune-heads run` and the recipes: load (loading.py), evaluate (evaluating.py), prune,
evaluate again, time in llama.cpp where asked (llama_cpp.py), write the model and its report (writing.py);
`run` (run.py) puts them together."""

from ..budgets import check_minimum
from .evaluating import changes, heads_kept, measure, measure_speed
from .loading import check_task, load_model, load_processor, resolve_source, task_data
from .run import run

__all__ = [
    "changes",
    "check_minimum",
    "check_task",
    "heads_kept",
    "load_model",
    "load_processor",
    "measure",
    "measure_speed",
    "resolve_source",
    "run",
    "task_data",
]
