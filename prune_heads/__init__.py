"""prune-heads: find and physically remove redundant attention heads from transformers models."""

from .config import PruneConfig, RecoveryConfig, ScoringConfig, SelectionConfig
from .data import TaskData, load_task_data
from .evaluation import evaluate_task
from .families import FAMILIES, AttentionSpec, register_family
from .gates import HeadGates, head_gates
from .gguf_export import GgufError, check_gguf, save_gguf
from .harness import LmEvalConfig, LmEvalError, lm_eval
from .head_scores import HeadScores
from .hub import model_card, push_pruned
from .iterative import IterativeResult, prune_iteratively
from .layers import AttentionLayer, UnsupportedModelError, find_attention, scan_attention
from .persistence import ModelNotFoundError, OutputExistsError, load_pruned, save_pruned
from .probe import probe_plan, prune
from .pruner import PruneResult, prune_model
from .recovery import reconstruct, tune_gates
from .report import Report, compare
from .scoring import METHODS, score_heads
from .selection import check_budget, plan_with_interactions, select_heads
from .speed import benchmark, benchmark_pair, heads_for_flops
from .surgery import PlanError, RecordError

__all__ = [
    "AttentionLayer", "AttentionSpec", "FAMILIES", "GgufError", "HeadGates", "HeadScores", "IterativeResult", "LmEvalConfig", "LmEvalError",
    "METHODS", "ModelNotFoundError", "OutputExistsError", "PlanError", "PruneConfig", "PruneResult",
    "RecordError", "RecoveryConfig", "Report", "ScoringConfig", "SelectionConfig", "TaskData",
    "UnsupportedModelError", "benchmark", "benchmark_pair", "check_budget", "check_gguf", "compare",
    "evaluate_task", "find_attention", "head_gates", "heads_for_flops", "lm_eval", "load_pruned", "load_task_data",
    "model_card", "plan_with_interactions", "probe_plan", "prune", "prune_iteratively", "prune_model",
    "push_pruned", "reconstruct", "register_family", "save_gguf", "save_pruned", "scan_attention",
    "score_heads", "select_heads", "tune_gates",
]
