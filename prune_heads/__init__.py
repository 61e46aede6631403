"""prune-heads: find and physically remove redundant attention heads from transformers models.

The public API, gathered from the wings: `model` (what heads are and how they are cut), `scoring` (how much each
head matters and which go), `recovery` (what is rebuilt after removal), `evaluation` (what changed) and `export`
(where the model goes); `prune_model` (pruner/) runs the whole flow, `PruneConfig` (config.py) describes it.
"""

from .budgets import Budget, resolve_budget
from .config import PruneConfig, RecoveryConfig, ScoringConfig, SelectionConfig
from .errors import ConfigError, PruneHeadsError
from .evaluation import LmEvalConfig, LmEvalError, Report, benchmark, benchmark_pair, compare, evaluate_task, lm_eval
from .export import (
    GgufError,
    ModelNotFoundError,
    OutputExistsError,
    check_gguf,
    load_pruned,
    model_card,
    push_pruned,
    save_gguf,
    save_pruned,
)
from .model import (
    FAMILIES,
    AttentionLayer,
    AttentionSpec,
    HeadGates,
    PlanError,
    RecordError,
    UnsupportedModelError,
    find_attention,
    head_gates,
    probe_plan,
    prune,
    register_family,
    scan_attention,
)
from .pruner import PruneResult, prune_model
from .recovery import reconstruct, tune_gates
from .runtime.ledger import Ledger, Stage
from .runtime.memory import map_large_blocks
from .scoring import (
    METHODS,
    HeadBudget,
    HeadScores,
    IterativeResult,
    KvCacheBudget,
    check_budget,
    heads_for_flops,
    heads_for_kv_cache,
    kv_cache_size,
    plan_with_interactions,
    prune_iteratively,
    score_heads,
    select_heads,
)
from .task_data import DataConfig, DataError, TaskData, load_task_data

__all__ = [
    "AttentionLayer",
    "AttentionSpec",
    "Budget",
    "ConfigError",
    "DataConfig",
    "DataError",
    "FAMILIES",
    "GgufError",
    "HeadGates",
    "HeadBudget",
    "HeadScores",
    "IterativeResult",
    "KvCacheBudget",
    "Ledger",
    "LmEvalConfig",
    "LmEvalError",
    "METHODS",
    "ModelNotFoundError",
    "OutputExistsError",
    "PlanError",
    "PruneConfig",
    "PruneHeadsError",
    "PruneResult",
    "RecordError",
    "RecoveryConfig",
    "Report",
    "ScoringConfig",
    "SelectionConfig",
    "Stage",
    "TaskData",
    "UnsupportedModelError",
    "benchmark",
    "benchmark_pair",
    "check_budget",
    "check_gguf",
    "compare",
    "evaluate_task",
    "find_attention",
    "head_gates",
    "heads_for_flops",
    "heads_for_kv_cache",
    "kv_cache_size",
    "lm_eval",
    "load_pruned",
    "load_task_data",
    "map_large_blocks",
    "model_card",
    "plan_with_interactions",
    "probe_plan",
    "prune",
    "prune_iteratively",
    "prune_model",
    "push_pruned",
    "reconstruct",
    "resolve_budget",
    "register_family",
    "save_gguf",
    "save_pruned",
    "scan_attention",
    "score_heads",
    "select_heads",
    "tune_gates",
]
