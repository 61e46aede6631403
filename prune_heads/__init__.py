"""prune-heads: find and physically remove redundant attention heads from transformers models."""

from .data import TaskData, load_task_data
from .evaluation import evaluate_task
from .families import FAMILIES, AttentionSpec, register_family
from .gates import HeadGates, head_gates
from .hub import model_card, push_pruned
from .iterative import IterativeResult, prune_iteratively
from .layers import AttentionLayer, UnsupportedModelError, find_attention
from .persistence import OutputExistsError, load_pruned, save_pruned
from .recovery import plan_with_interactions, reconstruct, tune_gates
from .report import Report, compare
from .scoring import METHODS, HeadScores, score_heads
from .selection import select_heads
from .speed import benchmark, benchmark_pair, heads_for_flops
from .surgery import PlanError, prune

__all__ = [
    "FAMILIES", "METHODS", "AttentionLayer", "AttentionSpec", "HeadGates", "HeadScores", "IterativeResult",
    "OutputExistsError", "PlanError", "Report", "TaskData", "UnsupportedModelError", "benchmark", "benchmark_pair",
    "compare", "evaluate_task", "find_attention", "head_gates", "heads_for_flops", "load_pruned", "load_task_data",
    "model_card", "plan_with_interactions", "prune", "prune_iteratively", "push_pruned", "reconstruct",
    "register_family", "save_pruned", "score_heads", "select_heads", "tune_gates",
]
