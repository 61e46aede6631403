"""lm-evaluation-harness on the model object in hand (the `lmeval` extra): its zero-shot and few-shot tasks,
before and after pruning, through lm-eval's own Hugging Face wrapper (HFLM), with no reload from disk.

Tasks are lm-eval's own YAML: its built-in ones (which download their data from the Hugging Face hub), the
ones prune-heads ships in `prune_heads/data/lm_eval` (offline: `sentence_endings`), and any folder given as
`include`. Each metric comes with lm-eval's standard error, and per example, so a before/after difference
gets a paired interval like every other metric (`prune_heads.confidence`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from ..runtime.devices import input_device
from ..runtime.progress import library_bars
from ..task_data import DataError
from .confidence import mean_of
from .task import Evaluation

SHIPPED_TASKS = Path(__file__).parents[1] / "data" / "lm_eval"


class LmEvalError(DataError):
    """An lm-eval task that cannot run here (unknown, or its data unreachable); the message says what to do."""


@dataclass(frozen=True)
class LmEvalConfig:
    """lm-eval tasks to run before and after pruning (`evaluation.lm_eval` in a recipe): task names, a folder
    of task YAMLs (`include`), at most `limit` examples per task, `num_fewshot` examples in each prompt (None:
    the task's own), the batch size of the wrapper."""

    tasks: list[str] = field(default_factory=list)
    include: str | None = None
    limit: int | None = None
    num_fewshot: int | None = None
    batch_size: int = 8


def _task_manager(include: str | Path | None):
    try:
        import lm_eval.tasks  # noqa: F401
    except ImportError:
        raise LmEvalError("lm-eval tasks need lm-evaluation-harness: pip install 'prune-heads[lmeval]'") from None

    if include and not Path(include).is_dir():
        raise LmEvalError(f"--lm-eval-include {include} is not a folder of lm-eval task YAMLs")
    folder = str(Path(include).resolve()) if include else None
    return _indexed(folder, _yaml_state(folder) if folder else ())


@functools.lru_cache(maxsize=4)
def _indexed(include: str | None, state: tuple) -> Any:
    """lm-eval's index of its thousands of task YAMLs takes seconds to build, so it is built once per process
    (per include folder and the state of its YAMLs, which `state` carries so an edited folder is read again;
    the four latest kept)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(SHIPPED_TASKS)] + ([include] if include else []))


def _yaml_state(folder: str) -> tuple:
    files = [p for p in sorted(Path(folder).rglob("*.y*ml")) if p.is_file()]
    return tuple((str(p), stat.st_mtime_ns, stat.st_size) for p, stat in zip(files, map(Path.stat, files)))


def _load_tasks(tasks: list[str], manager) -> dict:
    """lm-eval's task objects, their data loaded now, so a task that cannot run fails before any model work."""
    from lm_eval.tasks import get_task_dict

    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise LmEvalError(
            f"unknown lm-eval task {unknown[0]!r}: give a task lm-eval knows, one prune-heads ships "
            f"(sentence_endings), or a folder of task YAMLs with --lm-eval-include"
        )
    try:
        return get_task_dict(tasks, manager)
    except Exception as error:  # datasets and the hub raise ConnectionError, OSError, DatasetNotFoundError, ...
        raise LmEvalError(
            f"lm-eval task {','.join(tasks)} could not load its data ({type(error).__name__}); its "
            f"dataset comes from the Hugging Face hub, which cannot be reached: point lm-eval at "
            f"local files (a task YAML with dataset_path: json and dataset_kwargs: {{data_files: "
            f"{{test: FILE.jsonl}}}}) in a folder given with --lm-eval-include"
        ) from None


BOOTSTRAP = 1000  # lm-eval's resamples for the standard error of metrics that are not means (means: exact)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """lm-eval's progress bars off unless ours are wanted (`library_bars`), its notices to errors only."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with library_bars():
            yield
    finally:
        logger.setLevel(level)


def lm_eval(
    model: nn.Module,
    tokenizer: Any,
    tasks: list[str],
    include: str | Path | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    seed: int = 0,
) -> Evaluation:
    """Run lm-eval `tasks` on `model` (a causal LM object, pruned or not) with `tokenizer`.

    Returns an `Evaluation` whose metrics are named "task:metric" (with "task:metric_stderr", lm-eval's
    standard error) and whose statistics are each metric's per-example values (for paired comparisons).
    Seeded (`seed` for lm-eval's random, numpy, torch and few-shot sampling). Raises LmEvalError for an
    unknown task or one whose data cannot be had (a hub dataset offline), before the model runs.
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    manager = _task_manager(include)
    loaded = _load_tasks(list(tasks), manager)
    with _quiet():
        wrapper = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(input_device(model)))
        found = simple_evaluate(
            model=wrapper,
            tasks=list(loaded.values()),
            task_manager=manager,  # else lm-eval indexes its task YAMLs again, seconds per call
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=True,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
            bootstrap_iters=BOOTSTRAP,
        )
    result = Evaluation({})
    for task, values in found["results"].items():
        samples = sorted(found["samples"].get(task, []), key=lambda s: s["doc_id"])
        for key, value in values.items():
            metric, comma, _ = key.partition(",")  # lm-eval names them "metric,filter"
            if not comma or not isinstance(value, (int, float)):
                continue
            result.metrics[f"{task}:{metric}"] = value
            per_example = [s[metric] for s in samples if isinstance(s.get(metric), (int, float))]
            if not metric.endswith("_stderr") and len(per_example) == len(samples) and samples:
                result.statistics[f"{task}:{metric}"] = mean_of(per_example)
                if set(per_example) <= {0, 1}:
                    result.correct[f"{task}:{metric}"] = np.asarray(per_example, bool)
    return result
