"""What a run writes: the report of what it did and measured, and the pruned model with it, moved into place
in one step."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml
from torch import nn

from ..config import KvCacheBudget
from ..evaluation.report import Report, compare
from ..export.gguf import save_gguf
from ..export.persistence import replace_folder, write_model
from ..pruner import FRONTIER_RULE, PruneResult
from ..recipes import Recipe, recipe_to_dict
from ..recovery.generated import WRITTEN_EXAMPLES
from ..scoring.kv_cache import kv_cache_size


def _written_note(recipe: Recipe) -> str:
    """What a run without data calibrated on."""
    d = recipe.data
    examples = d.score_examples or WRITTEN_EXAMPLES
    return f"{examples} sequences of {d.max_length} tokens the model wrote itself (seed {recipe.scoring.seed})"


def budget_kv_cache(recipe: Recipe, model: nn.Module) -> dict[str, Any] | None:
    """The pruned model's KV cache against a KV-cache budget (None without one)."""
    if recipe.selection.kv_cache is None:
        return None
    budget = KvCacheBudget.parse(recipe.selection.kv_cache)
    size = kv_cache_size(model, budget.context, budget.cache_type)
    return {
        "budget": str(budget),
        "limit": budget.size,
        "context": budget.context,
        "type": budget.cache_type,
        "size": size,
    }


def run_report(
    recipe: Recipe,
    found: PruneResult,
    examples: int,
    before: dict,
    after: dict,
    changed: Any,
    kv_cache: dict[str, Any] | None,
    speeds: list[dict[str, Any]] | None = None,
) -> Report:
    """The report: before and after, the plan, the scores, the recovery's decisions and what they cost (and
    the KV cache a KV-cache budget asked for)."""
    meta = {
        "model": recipe.model,
        "task": recipe.task,
        "method": recipe.scoring.method,
        "steps": recipe.scoring.steps,
        "pruning_seconds": round(found.seconds, 2),
        "score_examples": examples,
        "timings": found.timings,
        "heldout": found.heldout,
        "asked_heads": found.asked,
        "work": found.work.as_dict() if found.work is not None else {},
        **({"kv_cache": kv_cache} if kv_cache else {}),
        **({"shared_kv_heads": found.sharing} if found.sharing else {}),
        **({"frontier": _frontier(recipe, found, speeds)} if found.frontier else {}),
        **({"calibration": _written_note(recipe)} if examples and recipe.data.source is None else {}),
    }
    return compare(
        before,
        after,
        plan=found.plan,
        scores=found.scores,
        history=found.history,
        meta=meta,
        recovery=found.recovery,
        changes=changed,
    )


def _frontier(recipe: Recipe, found: PruneResult, speeds: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The report's frontier: each depth measured, the context its KV cache is given at, the rule, and where
    measured llama.cpp's speeds."""
    depths = [asdict(depth) for depth in found.frontier]
    for depth, speed in zip(depths, speeds or []):
        depth["llama_cpp"] = speed
    return {
        "context": recipe.selection.context,
        "second_text": recipe.data.general_source or (found.heldout.get("general") or {}).get("source"),
        "rule": FRONTIER_RULE,
        "depths": depths,
    }


def write_output(
    recipe: Recipe, model: nn.Module, processor: Any, found: PruneResult, report: Report, target: Path, force: bool
) -> None:
    """The pruned model and what goes with it, into place in one move: a GGUF file alone where the output
    is one, else a folder with the model (or model.gguf), the report, the plan, the scores and the recipe."""
    written = recipe.written
    if written.format == "gguf" and target.suffix == ".gguf":
        save_gguf(model, target, tokenizer=processor, tensor_type=written.gguf_type, overwrite=force)
        return

    def write(tmp: Path) -> None:
        if written.format == "gguf":
            save_gguf(model, tmp / "model.gguf", tokenizer=processor, tensor_type=written.gguf_type)
        else:
            write_model(model, tmp, processor, standalone=recipe.standalone)
        report.write(tmp)
        (tmp / "plan.json").write_text(json.dumps(found.written_plan, indent=1))
        for depth in found.frontier[1:]:  # after the unpruned model: each depth's plans, to write one with --plan
            for plan in filter(None, (depth, depth.shared)):
                (tmp / plan.plan_file).parent.mkdir(exist_ok=True)
                (tmp / plan.plan_file).write_text(json.dumps(plan.written_plan, indent=1))
        if found.scores is not None:
            found.scores.save(tmp / "scores.json")
        (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))

    replace_folder(target, force, write)
