"""Scoring and selection: how much each head matters, and which heads go.

`objective` (the loss or divergence importance is measured against), `methods` (the registered scoring
methods and `score_heads`), `recording` (the unpruned model's statistics, taken during scoring),
`head_scores` (the saved result), `selection` (budgets and plans: `select_heads`, `check_budget`), `kv_cache`
(a KV-cache size as a head count) and `iterative` (re-scoring between steps).
"""

from ..config import KvCacheBudget
from .head_scores import HeadScores
from .iterative import IterativeResult, prune_iteratively
from .kv_cache import heads_for_kv_cache, kv_cache_size
from .methods import METHODS, score_heads
from .selection import HeadBudget, check_budget, heads_for_flops, plan_with_interactions, select_heads

__all__ = [
    "check_budget",
    "HeadBudget",
    "heads_for_flops",
    "heads_for_kv_cache",
    "HeadScores",
    "IterativeResult",
    "KvCacheBudget",
    "kv_cache_size",
    "METHODS",
    "plan_with_interactions",
    "prune_iteratively",
    "score_heads",
    "select_heads",
]
