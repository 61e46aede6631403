"""`prune_model`, the whole flow in one call (flow.py), what it returns and records (run.py), and the depths it
measures along the searched order: a quality bound's and a frontier's (depths.py)."""

from ..runtime.ledger import BEFORE_TUNING, Ledger, Stage
from .depths import FRONTIER_CACHE_TYPES, FRONTIER_RULE, MAX_LOSS_RULE
from .flow import prune_model
from .records import PruneResult

__all__ = [
    "BEFORE_TUNING",
    "FRONTIER_CACHE_TYPES",
    "FRONTIER_RULE",
    "Ledger",
    "MAX_LOSS_RULE",
    "PruneResult",
    "Stage",
    "prune_model",
]
