"""`run`: a recipe end to end, from loading to the written model and its report."""

from __future__ import annotations

import copy
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from ..budgets import check_given, check_minimum, given_plan, resolve_budget
from ..config import PruneConfig
from ..errors import ConfigError
from ..evaluation.analysis import Analysis, analyze
from ..evaluation.report import Report
from ..export.gguf import check_gguf
from ..export.persistence import ensure_file_free, ensure_free
from ..model.kv_sharing import share_kv_heads
from ..model.layers import find_attention
from ..model.onload import check_offload, onload_offloaded
from ..model.probe import prune
from ..pruner import PruneResult, prune_model
from ..recipes import Recipe
from ..runtime.parallel import is_main
from ..scoring.iterative import prune_iteratively
from ..task_data import TaskData, without_labels
from .evaluating import changes, measure, measure_speed
from .llama_cpp import frontier_in_llama_cpp, llama_speeds
from .loading import RunData, load_model, load_processor, run_data
from .writing import budget_kv_cache, run_report, write_output


def run(
    recipe: Recipe,
    output: str | Path | None = None,
    force: bool = False,
    plan: dict | None = None,
    evaluate: bool = True,
    progress: bool = True,
    resume: bool = False,
) -> Report:
    """Run a recipe end to end and write the pruned model with its report to the output folder.

    Evaluates before, scores, selects and prunes (or applies `plan`), evaluates after, then writes the
    model, tokenizer, report (JSON, Markdown, PNGs), scores, plan and the recipe itself into a temporary
    folder that is renamed into place, so nothing half-written is left. With `output.format: gguf` the model
    is one GGUF file (`save_gguf`): the output itself when its path ends in .gguf (then only that file is
    written), else model.gguf in the folder. An existing output is an OutputExistsError unless `force`;
    what no GGUF file can hold is refused (GgufError) before any data is read. A heal (`recovery.heal`) keeps
    its checkpoints in `recovery.heal_checkpoints`, by default the output's path with '.heal' added, removed
    once the model is written; `resume` continues from them.
    """
    target = Path(output or recipe.written.path or "pruned-model")
    recipe = _with_checkpoints(recipe, target)
    gguf_file = recipe.written.format == "gguf" and target.suffix == ".gguf"
    (ensure_file_free if gguf_file else ensure_free)(target, force)  # before any work
    model = load_model(recipe)
    config = PruneConfig.from_recipe(recipe)
    check_offload(model)
    _check_budget(recipe, model, config, plan)
    recovers = _recovers(recipe, plan)
    if recipe.recovery.heal and not recovers:
        raise ConfigError("recovery.heal trains on calibration data, and this run has none: give --data with --plan")
    if force and not resume and recipe.recovery.heal_checkpoints == str(_checkpoints(target)):
        shutil.rmtree(_checkpoints(target), ignore_errors=True)  # a fresh run over the last one's checkpoints
    processor = load_processor(recipe)
    if recipe.written.format == "gguf":
        _check_gguf(recipe, model, config, processor, recovers, target, force)
    data = run_data(recipe, model, processor, recovers, evaluate, progress)
    before, evaluated = measure(model, data.evaluation, recipe, data.reference, data.train, processor, progress)
    timed = evaluate and recipe.evaluation.speed is not None
    in_llama = frontier_in_llama_cpp(recipe, plan)
    original = copy.deepcopy(model) if timed or in_llama else None  # timed beside the pruned one, in turns
    heads = _analysis(recipe, model, data, progress)
    found, examples = _prune(model, data, config, plan, recovers, progress, resume)
    after, evaluated_after = measure(model, data.evaluation, recipe, data.reference, data.train, processor, progress)
    if timed and original is not None:
        before["speed"], after["speed"] = measure_speed([original, model], recipe)
    main = is_main()  # data-parallel: every process holds the same model; the first one writes it
    speeds = llama_speeds(recipe, original, found, processor, data.score, progress) if in_llama and main else None
    del original
    changed = changes(evaluated, evaluated_after, recipe.scoring.seed)
    report = run_report(recipe, found, examples, before, after, changed, budget_kv_cache(recipe, model), speeds)
    report = replace(report, analysis=heads)
    if main:
        write_output(recipe, model, processor, found, report, target, force)
        if recipe.recovery.heal_checkpoints == str(_checkpoints(target)):
            shutil.rmtree(_checkpoints(target), ignore_errors=True)  # the model they were for is written
    return report


def _analysis(recipe: Recipe, model: nn.Module, data: RunData, progress: bool) -> Analysis | None:
    """The unpruned model's heads on the scoring data against the run's objective, for the page the run writes
    (`evaluation.analysis`)."""
    if not recipe.evaluation.analysis or data.score is None:
        return None
    batches = data.score.without_labels() if recipe.scoring.objective == "label-free" else data.score
    return analyze(model, batches, seed=recipe.scoring.seed, progress=progress)


def _checkpoints(target: Path) -> Path:
    """The heal's checkpoint folder beside the output, by default."""
    return target.with_name(target.name + ".heal")


def _with_checkpoints(recipe: Recipe, target: Path) -> Recipe:
    """`recipe` with the heal's checkpoints beside the output where it heals and names no folder."""
    r = recipe.recovery
    if not r.heal or r.heal_checkpoints is not None:
        return recipe
    return replace(recipe, recovery=replace(r, heal_checkpoints=str(_checkpoints(target))))


def _recovers(recipe: Recipe, plan: dict | None) -> bool:
    """Whether the run scores or recovers on calibration data: always without a plan; with one, where data is
    given and recovery on (else the plan is applied as it is)."""
    return plan is None or recipe.data.source is not None and recipe.recovery.enabled


def _check_budget(recipe: Recipe, model: nn.Module, config: PruneConfig, plan: dict | None) -> None:
    """The budget (or the plan) against the model's structure, before any data is read."""
    length = recipe.evaluation.speed.seq_len if recipe.evaluation.speed else recipe.data.max_length
    if plan is None:
        resolve_budget(model, config, seq_len=length)
    else:
        check_given(config)
        removals, _ = given_plan(find_attention(model), plan)
        check_minimum(model, removals, recipe.selection.min_heads_per_layer)


def _check_gguf(
    recipe: Recipe, model: nn.Module, config: PruneConfig, processor: Any, scored: bool, target: Path, force: bool
) -> None:
    """Whether a GGUF file can hold the result, before any data is read (a given plan's pruned model is
    checked when written)."""
    r = config.recovery
    check_gguf(
        model,
        processor,
        tensor_type=recipe.written.gguf_type,
        output=target if target.suffix == ".gguf" else None,
        overwrite=force,
        uniform=config.selection.uniform if scored else None,
        output_biases=r.enabled and (r.bias_compensation or r.bias_tuning) if scored else None,
    )


def _prune(
    model: nn.Module,
    data: RunData,
    config: PruneConfig,
    plan: dict | None,
    recovers: bool,
    progress: bool,
    resume: bool = False,
) -> tuple[PruneResult, int]:
    """The default path on the scoring batches where the run `recovers` (a given plan with its recovery;
    iterative pruning where `scoring.steps` asks for it), else the given plan applied as it is; and the examples
    scored."""
    if config.scoring.steps > 1:
        assert data.score is not None  # loaded whenever the run recovers, as an iterative run does
        found = _prune_iteratively(model, data.score, config, progress)
        return found, data.score.num_examples
    if recovers:
        assert data.score is not None  # loaded whenever the run recovers
        found = prune_model(model, data.score, config, progress, data.second, plan, heal_data=data.heal, resume=resume)
        return found, data.score.num_examples
    assert plan is not None  # a run without a plan always recovers
    tick = time.perf_counter()
    onload_offloaded(model)  # a plan's layers are cut where their weights are
    removals, sharing = given_plan(find_attention(model), plan)
    prune(model, removals)
    if sharing:  # keys read as they are: their maps are fitted on calibration data
        share_kv_heads(model, sharing)
    return PruneResult(plan=removals, seconds=time.perf_counter() - tick, sharing=sharing), 0


def _prune_iteratively(model: nn.Module, data: TaskData, config: PruneConfig, progress: bool) -> PruneResult:
    """`prune_iteratively` at the budget `config` sets, as the report takes it."""
    tick, s = time.perf_counter(), config.scoring
    budget = resolve_budget(model, config)
    onload_offloaded(model)  # its layers are cut where their weights are
    batches = [without_labels(b) for b in data] if s.objective == "label-free" else list(data)
    found = prune_iteratively(model, batches, budget.heads, s.steps, s.method, seed=s.seed, progress=progress)
    seconds = time.perf_counter() - tick
    return PruneResult(found.plan, found.scores, found.history, asked=budget.asked, seconds=seconds)
