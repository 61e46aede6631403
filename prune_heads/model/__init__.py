"""Model adapters: what a model's attention heads are and how they are cut, exactly.

`families` (where each transformers attention module keeps its heads, as data), `layers` (finding the
attention layers and describing their heads), `hooks` and `gates` (a gate per head on any backend),
`surgery` (slicing the projections and recording what was removed), `probe` (`prune`, which proves each
planned layer on a copy before it changes anything), `kv_sharing` (KV heads merged into others, every query head
kept) and `blocks` (forward passes that start at a block, for measuring a change at or after it). Nothing
here knows about data, scores or budgets.
"""

from .families import FAMILIES, AttentionSpec, register_family
from .gates import HeadGates, head_gates
from .kv_sharing import share_kv_heads
from .layers import AttentionLayer, UnsupportedModelError, find_attention, scan_attention
from .probe import probe_plan, prune
from .surgery import PlanError, RecordError

__all__ = [
    "AttentionLayer",
    "AttentionSpec",
    "FAMILIES",
    "find_attention",
    "head_gates",
    "HeadGates",
    "PlanError",
    "probe_plan",
    "prune",
    "RecordError",
    "register_family",
    "scan_attention",
    "share_kv_heads",
    "UnsupportedModelError",
]
