"""prune-heads: find and physically remove redundant attention heads from transformers models."""

from .families import FAMILIES, AttentionSpec, register_family
from .gates import HeadGates, head_gates
from .layers import AttentionLayer, UnsupportedModelError, find_attention
from .persistence import OutputExistsError, load_pruned, save_pruned
from .surgery import PlanError, prune

__all__ = [
    "FAMILIES", "AttentionLayer", "AttentionSpec", "HeadGates", "OutputExistsError", "PlanError",
    "UnsupportedModelError", "find_attention", "head_gates", "load_pruned", "prune", "register_family",
    "save_pruned",
]
