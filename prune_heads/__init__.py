"""prune-heads: find and physically remove redundant attention heads from transformers models."""

from .families import FAMILIES, AttentionSpec, register_family
from .gates import HeadGates, head_gates
from .iterative import IterativeResult, prune_iteratively
from .layers import AttentionLayer, UnsupportedModelError, find_attention
from .persistence import OutputExistsError, load_pruned, save_pruned
from .scoring import METHODS, HeadScores, score_heads
from .selection import select_heads
from .surgery import PlanError, prune

__all__ = [
    "FAMILIES", "METHODS", "AttentionLayer", "AttentionSpec", "HeadGates", "HeadScores", "IterativeResult",
    "OutputExistsError", "PlanError", "UnsupportedModelError", "find_attention", "head_gates", "load_pruned",
    "prune", "prune_iteratively", "register_family", "save_pruned", "score_heads", "select_heads",
]
