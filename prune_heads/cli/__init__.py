"""The `prune-heads` command line: a thin layer over the public API and the recipes."""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

import click

from ..config import BUDGETS, CHOICES, RecoveryConfig, ScoringConfig, SelectionConfig
from ..export.persistence import load_pruned
from ..model.layers import scan_required
from ..recipes import load_recipe, recipe_path, shipped_recipes
from ..scoring.methods import METHODS
from .analyze import analyze
from .demo import demo
from .options import (
    BUDGET,
    GGUF_TYPE_HELP,
    OWN_PROCESS,
    Registered,
    asked_line,
    calibration_line,
    config_fields,
    config_option,
    data_options,
    emit,
    frontier_lines,
    handle_errors,
    heal_line,
    heldout_line,
    kv_cache_line,
    launched,
    make_recipe,
    max_loss_line,
    processes_option,
    quiet_transformers,
    read_plan,
    task_metrics,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option(
    "--quiet",
    "-q",
    is_flag=True,
    help="No progress bars or warnings on stderr, only errors (bars are "
    "also off when TQDM_DISABLE=1 or stderr is not a terminal).",
)
@click.option("--traceback", is_flag=True, help="Show the traceback of an input error too (exit 2 stays one line).")
def main(quiet: bool, traceback: bool) -> None:
    """Find and physically remove redundant attention heads from transformers models.

    Example: prune-heads run fixture-minilm-sentiment --set selection.sparsity=0.5
    """
    quiet_transformers()
    if quiet:
        os.environ["TQDM_DISABLE"] = "1"
        logging.getLogger("prune_heads").setLevel(logging.ERROR)
        warnings.simplefilter("ignore")


@main.command()
@click.argument("model_path")
@click.option("--gguf-file", default=None, help="GGUF file inside MODEL_PATH's folder (or hub repo) to load.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")
@handle_errors
def inspect(model_path: str, gguf_file: str | None, as_json: bool) -> None:
    """Print the attention layers and heads of a checkpoint (a local folder or a hub id).

    Example: prune-heads inspect ./pruned-fixture
    """
    if model_path.endswith(".gguf") and Path(model_path).is_file() and not gguf_file:
        _inspect_gguf(model_path, as_json)
        return
    model = load_pruned(model_path, **({"gguf_file": gguf_file} if gguf_file else {}))
    layers, skipped = scan_required(model)
    unsupported = [{"name": u.name, "class": u.class_name, "why": u.why} for u in skipped]
    rows: list[dict[str, Any]] = [
        {
            "index": l.index,
            "name": l.name,
            "kind": l.kind,
            "family": l.spec.name,
            "heads": l.num_heads,
            "kv_heads": l.num_kv_heads,
            "head_dim": l.head_dim,
            "original_heads": l.original_num_heads,
            "kept": list(l.heads),
        }
        for l in layers
    ]
    summary: dict[str, Any] = {
        "model": model_path,
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "heads": sum(r["heads"] for r in rows),
        "original_heads": sum(r["original_heads"] for r in rows),
        "layers": rows,
        "unsupported": unsupported,
    }

    def text() -> str:
        lines = [
            f"{model_path}: {summary['architecture']}, {summary['parameters']:,} parameters, "
            f"{summary['heads']} of {summary['original_heads']} heads",
            f"{'#':>3}  {'layer':48} {'kind':5} {'family':10} {'heads':>7} {'kv':>4} {'dim':>4}  kept",
        ]
        for r in rows:
            kept = ",".join(map(str, r["kept"])) if r["heads"] < r["original_heads"] else "all"
            lines.append(
                f"{r['index']:>3}  {r['name'][-48:]:48} {r['kind']:5} {r['family']:10} "
                f"{r['heads']:>3}/{r['original_heads']:<3} {r['kv_heads']:>4} {r['head_dim']:>4}  {kept}"
            )
        lines += [f"  -  {u['name'][-48:]:48} left as it is ({u['class']}): {u['why']}" for u in unsupported]
        return "\n".join(lines)

    emit(summary, as_json, text)


def _inspect_gguf(path: str, as_json: bool) -> None:
    """`inspect` of a GGUF file: its architecture, per-layer heads and what prune-heads recorded in it."""
    from ..export.gguf import gguf_heads

    found = gguf_heads(path)

    def text() -> str:
        record = found["record"] or {}
        lines = [
            f"{path}: GGUF {found['architecture']}, {found['bytes'] / 2**20:.1f} MiB, {found['tensors']} tensors, "
            f"{sum(found['heads'])} heads"
            + (
                f", pruned by prune-heads from a source with sha256 {found['source_sha256'][:16]}..."
                if found["source_sha256"]
                else ""
            ),
            f"{'block':>5}  {'heads':>5} {'kv':>4}  removed (original indices)",
        ]
        blocks = {name: re.search(r"\.(\d+)\.", name) for name in record.get("layers") or {}}  # model.layers.N.*
        removed = {
            int(found.group(1)): record["layers"][name].get("removed", []) for name, found in blocks.items() if found
        }
        for i, (heads, kv) in enumerate(zip(found["heads"], found["kv_heads"])):
            gone = ",".join(map(str, removed.get(i, []))) or "-"
            lines.append(f"{i:>5}  {heads:>5} {kv:>4}  {gone}")
        return "\n".join(lines)

    emit(found, as_json, text)


@main.command()
@click.argument("model")
@data_options
@config_option(ScoringConfig, "method", type=Registered(METHODS))
@click.option("--label-free", is_flag=True, help="Ignore labels: score against the unpruned model's outputs.")
@click.option(
    "--output", "-o", default="head-scores", show_default=True, help="Folder for scores.json and heatmap.png."
)
@click.option("--force", is_flag=True, help="Overwrite the output folder.")
@processes_option("Score")
@handle_errors
def score(model: str, method: str, label_free: bool, output: str, force: bool, processes: int, **opts: Any) -> None:
    """Score every head on a dataset; writes scores.json and heatmap.png.

    Example: prune-heads score ./model --data glue --split validation --method fisher -o scores --processes 2
    """
    from ..evaluation.report import heatmap
    from ..export.persistence import ensure_free, replace_folder
    from ..pipeline import load_model, load_processor, task_data
    from ..scoring.methods import score_heads

    recipe = make_recipe(model, opts, scoring={"method": method, "objective": "label-free" if label_free else "auto"})
    ensure_free(Path(output), force)  # before any work
    state = launched(processes)
    loaded = load_model(recipe)
    processor = load_processor(recipe)
    data = task_data(recipe, loaded, processor, opts["split"], opts["examples"])
    batches = data.without_labels() if label_free else data.batches
    scores = score_heads(loaded, batches, method=method, seed=opts["seed"])
    if state is not None and not state.is_main_process:
        return  # every process holds the same scores; the first one writes them

    def write(tmp: Path) -> None:
        scores.save(tmp / "scores.json")
        heatmap(scores, tmp / "heatmap.png", {})

    replace_folder(Path(output), force, write)
    emit(
        scores.to_dict(),
        opts["as_json"],
        lambda: (
            f"scored {sum(len(v) for v in scores.heads.values())} heads "
            f"on {scores.num_examples} examples ({method}); wrote {output}/scores.json and {output}/heatmap.png"
        ),
    )


@main.command(name="prune")
@click.argument("model")
@data_options
@config_option(SelectionConfig, "sparsity", type=float)
@config_option(SelectionConfig, "num_heads", type=click.IntRange(min=0))
@config_option(SelectionConfig, "flops", type=float)
@config_option(SelectionConfig, "kv_cache")
@config_option(SelectionConfig, "max_loss", type=float)
@config_option(SelectionConfig, "depths")
@click.option(
    "--eval-data",
    "general_source",
    default=None,
    help="A second text (read as --data is, its --split) every decision weighs beside the held-out calibration "
    "text, in place of the model's own written text, and each of --depths is measured on.",
)
@config_option(SelectionConfig, "context", type=click.IntRange(min=1))
@click.option(
    "--plan",
    "plan_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="JSON {layer: [heads]} (such as a frontier depth's, frontier/plan-1-3.json, or a run's plan.json with "
    "the KV heads it shares) removed instead of scoring and the search: with --data, recovered as the default "
    "path recovers; without, as it is.",
)
@config_option(ScoringConfig, "method", type=Registered(METHODS))
@config_option(ScoringConfig, "steps", type=int)
@config_option(SelectionConfig, "scope", type=click.Choice(CHOICES["selection.scope"]))
@config_option(SelectionConfig, "min_heads_per_layer", type=int)
@config_option(SelectionConfig, "gqa", type=click.Choice(CHOICES["selection.gqa"]))
@config_option(SelectionConfig, "granularity", type=click.Choice(CHOICES["selection.granularity"]))
@config_option(SelectionConfig, "round", type=click.Choice(CHOICES["selection.round"]))
@config_option(SelectionConfig, "uniform", is_flag=True)
@click.option(
    "--recovery/--no-recovery",
    default=True,
    show_default=True,
    help="Recovery steps, each kept only if it helps on held-out calibration data.",
)
@config_option(RecoveryConfig, "rearrange")
@config_option(RecoveryConfig, "reconstruction")
@config_option(RecoveryConfig, "kv_sharing")
@config_option(RecoveryConfig, "bias_compensation")
@config_option(RecoveryConfig, "gate_tuning")
@config_option(RecoveryConfig, "bias_tuning")
@config_option(RecoveryConfig, "projection_tuning")
@config_option(RecoveryConfig, "general", type=click.Choice(CHOICES["recovery.general"]))
@config_option(RecoveryConfig, "generated_share", type=click.FloatRange(min=0))
@config_option(RecoveryConfig, "search_rounds", type=click.IntRange(min=0))
@config_option(RecoveryConfig, "search_screen")
@config_option(RecoveryConfig, "epochs", type=int)
@config_option(RecoveryConfig, "tuning_budget", type=BUDGET, default="none")
@config_option(RecoveryConfig, "holdout", type=float)
@config_option(RecoveryConfig, "heal", type=str)
@click.option(
    "--heal-data",
    default=None,
    help="A corpus the heal trains on (read as --data is) in place of the model's own written text.",
)
@click.option("--heal-split", default="train", show_default=True, help="The split of --heal-data.")
@config_option(RecoveryConfig, "heal_rank", type=click.IntRange(min=0))
@config_option(RecoveryConfig, "heal_every", type=str)
@config_option(RecoveryConfig, "heal_checkpoints")
@click.option(
    "--resume", is_flag=True, help="Continue the heal from its checkpoints (the same command, inputs and flags)."
)
@click.option(
    "--standalone",
    is_flag=True,
    help="Add a modeling file so from_pretrained(trust_remote_code=True) loads it without prune-heads.",
)
@click.option(
    "--output",
    "-o",
    required=True,
    help="Folder for the pruned model (must not exist, see --force), or FILE.gguf with --output-format gguf.",
)
@click.option(
    "--output-format",
    type=click.Choice(CHOICES["output.format"]),
    default=None,
    help="safetensors (a transformers folder) or gguf (one file for llama.cpp); default: gguf when -o ends in .gguf.",
)
@click.option(
    "--gguf-type",
    type=click.Choice(CHOICES["output.gguf_type"]),
    default=None,
    help=GGUF_TYPE_HELP,
)
@click.option("--force", is_flag=True, help="Overwrite the output folder.")
@processes_option("Prune")
@handle_errors
def prune_command(
    model: str, plan_file: str | None, recovery: bool, output: str, processes: int, resume: bool, **opts: Any
) -> None:
    """Score, select and remove heads (or apply --plan); saves a model that ph.load_pruned loads (or a GGUF
    file that llama.cpp runs: --output-format gguf -o FILE.gguf).

    With no other flags this is the best measured path: fisher scores, then the plan and each recovery step
    decided on held-out calibration data. Without --data a decoder (--task causal-lm) calibrates on text it
    writes itself. Example:
    prune-heads prune ./model --data reviews.jsonl --sparsity 0.5 -o ./pruned
    """
    from ..pipeline import run
    from ..runtime.parallel import is_main

    selection = config_fields(SelectionConfig, opts)
    budgets = {k: selection.pop(k) for k in BUDGETS if k in selection}  # the command's: keep_per_layer is not
    if sum(v is not None for v in budgets.values()) + (plan_file is not None) != 1:
        raise click.UsageError(
            "give exactly one of --sparsity, --num-heads, --keep-flops, --kv-cache, --max-loss or --plan"
        )
    plan = read_plan(plan_file) if plan_file else None
    if opts["general_source"] and opts["general"] == "off" and not selection.get("depths"):
        raise click.UsageError(
            "--general off judges on the calibration's text alone: give --eval-data only with --depths, or "
            "--general report"
        )
    if plan is not None and selection.get("depths"):
        raise click.UsageError("--depths measures the searched order, and --plan applies a plan without one")
    selection.update({k: v for k, v in budgets.items() if v is not None} or {"sparsity": 0.0})
    steps = config_fields(RecoveryConfig, opts)
    kept = {k: steps[k] for k in ("holdout", "epochs", "generated_share", "heal")}  # checked with recovery off too
    recovery_section = steps if recovery else {**vars(RecoveryConfig.off()), **kept}
    fmt = opts["output_format"] or ("gguf" if output.endswith(".gguf") else "safetensors")
    recipe = make_recipe(
        model,
        opts,
        needs_data=plan is None and opts["task"] != "causal-lm",
        selection=selection,
        scoring={"method": opts["method"], "steps": opts["steps"]},
        standalone=opts["standalone"],
        recovery=recovery_section,
        output={"path": output, "format": fmt, "gguf_type": opts["gguf_type"]},
        data=_other_texts(opts),
    )
    launched(processes)
    report = run(recipe, output=output, force=opts["force"], plan=plan, evaluate=False, resume=resume)
    if not is_main():
        return  # every process holds the same model; the first one wrote it and says so
    emit(
        report.to_dict(),
        opts["as_json"],
        lambda: (
            f"removed {report.summary()['heads']['removed']} heads{max_loss_line(report)}{heldout_line(report)}"
            f"{kv_cache_line(report)}"
            f"{calibration_line(report)}{heal_line(report)}; saved the pruned model to {output}"
            + asked_line(selection, report)
            + frontier_lines(report, output)
        ),
    )


def _other_texts(opts: dict[str, Any]) -> dict[str, Any]:
    """The data section's other texts: the guard's (--eval-data) and the heal's corpus (--heal-data, its split)."""
    return {
        "general_source": opts["general_source"],
        "heal_source": opts["heal_data"],
        "heal_split": opts["heal_split"],
    }


@main.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.argument("repo_id")
@click.option("--base-model", default=None, help="Hub id of the unpruned model (default: from the report).")
@click.option("--private", is_flag=True, help="Create the repo as private.")
@click.option("--token", default=None, help="Hub token (default: the one huggingface-cli login saved).")
@handle_errors
def push(folder: str, repo_id: str, base_model: str | None, private: bool, token: str | None) -> None:
    """Push a pruned model folder to the Hugging Face Hub with a model card (base model, plan, before/after).

    Example: prune-heads push ./pruned-bert-sst2 me/bert-base-sst2-pruned-50
    """
    from ..export.hub import push_pruned

    info = push_pruned(folder, repo_id, base_model=base_model, private=private or None, token=token)
    click.echo(f"pushed {folder} to {repo_id}: {getattr(info, 'commit_url', info)}")


@main.command(name="evaluate")
@click.argument("model")
@data_options
@click.option(
    "--metric",
    "metrics",
    multiple=True,
    default=("accuracy",),
    show_default=True,
    help="evaluate metric (repeatable): accuracy, f1, matthews_correlation or any hub metric.",
)
@click.option("--speed/--no-speed", default=True, show_default=True, help="Also measure latency and FLOPs.")
@click.option(
    "--train-split",
    default=None,
    help="Embedding models (--task feature-extraction) with labelled "
    "data: train a logistic regression and a k-NN classifier on this split's embeddings and report "
    "their accuracy on --split.",
)
@click.option(
    "--lm-eval",
    "lm_eval_tasks",
    default=None,
    help="lm-evaluation-harness tasks (comma list) for a "
    "causal LM, e.g. sentence_endings (shipped, offline) or arc_easy,hellaswag (their data from the hub).",
)
@click.option("--lm-eval-include", default=None, help="A folder of lm-eval task YAMLs (lm-eval's own format).")
@click.option("--lm-eval-limit", type=click.IntRange(min=1), default=None, help="At most this many examples a task.")
@click.option("--lm-eval-fewshot", type=click.IntRange(min=0), default=None, help="Few-shot examples per prompt.")
@click.pass_context
@handle_errors
def evaluate_command(
    ctx: click.Context,
    model: str,
    metrics: tuple[str, ...],
    speed: bool,
    train_split: str | None,
    lm_eval_tasks: str | None,
    lm_eval_include: str | None,
    lm_eval_limit: int | None,
    lm_eval_fewshot: int | None,
    **opts: Any,
) -> None:
    """Print the task metrics and speed of a (pruned) model; with --lm-eval, lm-eval tasks with their
    standard errors (then --data is optional and the task is causal-lm).

    Example: prune-heads evaluate ./pruned --data reviews.jsonl --split test --metric accuracy --metric f1
    """
    from ..pipeline import load_model, load_processor, measure, measure_speed, task_data

    if lm_eval_tasks:
        if ctx.get_parameter_source("task") == click.core.ParameterSource.DEFAULT:
            opts["task"] = "causal-lm"
        elif opts["task"] != "causal-lm":
            raise click.UsageError("--lm-eval evaluates causal language models: use --task causal-lm")
    harness = (
        {
            "tasks": [t.strip() for t in lm_eval_tasks.split(",") if t.strip()],
            "include": lm_eval_include,
            "limit": lm_eval_limit,
            "num_fewshot": lm_eval_fewshot,
        }
        if lm_eval_tasks
        else None
    )
    recipe = make_recipe(
        model,
        opts,
        needs_data=harness is None,
        labels=train_split is not None,
        data={"eval_split": opts["split"]},
        evaluation={"metrics": task_metrics(opts["task"], metrics), "speed": {} if speed else None, "lm_eval": harness},
    )
    loaded = load_model(recipe)
    processor = load_processor(recipe)
    train = task_data(recipe, loaded, processor, train_split, opts["examples"]) if train_split else None
    data = task_data(recipe, loaded, processor, opts["split"], opts["examples"], like=train) if opts["source"] else None
    result, _ = measure(loaded, data, recipe, train=train, tokenizer=processor)
    if speed:
        result["speed"] = measure_speed([loaded], recipe)[0]

    emit(result, opts["as_json"], lambda: _evaluation_text(result))


def _evaluation_text(result: dict) -> str:
    """`evaluate`'s result as lines a person reads: metrics with their standard errors, heads, speed."""
    found = result["metrics"]
    lines = [
        f"{k}: {v:.4f}" + (f" ± {found[k + '_stderr']:.4f}" if isinstance(found.get(k + "_stderr"), float) else "")
        if isinstance(v, float)
        else f"{k}: {v}"
        for k, v in found.items()
        if not k.endswith("_stderr")
    ]
    lines.append(f"heads: {sum(result['heads'].values())}")
    if "speed" in result:
        s = result["speed"]
        lines += [
            f"parameters: {s['parameters']:,}",
            f"GFLOPs per forward: {s['flops'] / 1e9:.2f}",
            f"latency: {s['latency_ms']:.1f} ms median, {s['latency_p90_ms']:.1f} ms p90 "
            f"(batch {s['settings']['batch_size']}, seq {s['settings']['seq_len']}, {s['settings']['device']})",
        ]
    return "\n".join(lines)


@main.command(name="run")
@click.argument("recipe")
@click.option("--set", "overrides", multiple=True, help="Override a recipe key, e.g. --set selection.sparsity=0.25.")
@click.option("--output", "-o", default=None, help="Output folder (default: the recipe's output).")
@click.option("--force", is_flag=True, help="Overwrite the output folder.")
@click.option(
    "--gguf-file", default=None, help="GGUF file inside the recipe's model folder (sets model_kwargs.gguf_file)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report JSON on stdout.")
@handle_errors
def run_command(
    recipe: str, overrides: tuple[str, ...], output: str | None, force: bool, gguf_file: str | None, as_json: bool
) -> None:
    """Run a recipe end to end: evaluate, score, select, prune, evaluate, save model and report.

    RECIPE is a YAML file or the name of a shipped recipe (see `prune-heads recipes`).
    Example: prune-heads run fixture-minilm-sentiment --set selection.sparsity=0.25 -o pruned-25
    """
    from ..pipeline import run

    parsed = load_recipe(recipe, [*overrides, *([f"model_kwargs.gguf_file={gguf_file}"] if gguf_file else [])])
    report = run(parsed, output=output, force=force)
    target = output or parsed.written.path or "pruned-model"
    emit(report.to_dict(), as_json, lambda: report.markdown() + f"\nSaved the model and report to {target}/")


@main.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--output", "-o", required=True, help="The GGUF file to write.")
@click.option(
    "--gguf-source",
    default=None,
    help="The GGUF file the model came from (default: the one recorded "
    "when it was loaded with --gguf-file); its unchanged tensors are copied byte for byte.",
)
@click.option(
    "--gguf-type",
    type=click.Choice(CHOICES["output.gguf_type"]),
    default=None,
    help=GGUF_TYPE_HELP,
)
@click.option("--force", is_flag=True, help="Overwrite the output file.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")
@handle_errors
def export(
    folder: str, output: str, gguf_source: str | None, gguf_type: str | None, force: bool, as_json: bool
) -> None:
    """Write a folder that `prune` or `run` saved (or a Llama, Mistral, Qwen or Phi-3 checkpoint) as one GGUF file.

    Example: prune-heads export ./pruned-smollm2 -o smollm2-pruned.gguf
    """
    from transformers import AutoTokenizer

    from ..export.gguf import save_gguf

    model = load_pruned(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder) if (Path(folder) / "tokenizer_config.json").exists() else None
    result = save_gguf(model, output, source=gguf_source, tokenizer=tokenizer, tensor_type=gguf_type, overwrite=force)
    summary = {
        "path": str(result.path),
        "architecture": result.architecture,
        "heads": result.heads,
        "kv_heads": result.kv_heads,
        "copied": len(result.copied),
        "written": result.written,
    }
    emit(
        summary,
        as_json,
        lambda: (
            f"wrote {output}: GGUF {result.architecture}, {sum(result.heads)} heads, "
            f"{len(result.copied)} tensors copied byte for byte, {len(result.written)} written anew"
        ),
    )


@main.command()
@click.argument("name", required=False)
@handle_errors
def recipes(name: str | None) -> None:
    """List the shipped recipes, or print one.

    Example: prune-heads recipes bert-base-sst2
    """
    if name:
        click.echo(recipe_path(name).read_text())
        return
    for recipe_name, path in sorted(shipped_recipes().items()):
        description = load_recipe(str(path)).description
        click.echo(f"{recipe_name:32} {description}")


main.add_command(analyze)
main.add_command(demo)


def entry() -> None:
    """The `prune-heads` command: `main` in a process of its own, whose C allocator its commands may set up
    (`map_large_blocks`: the scoring pass and the default path peak lower on the CPU); the library leaves that
    to its caller."""
    main(obj={OWN_PROCESS: True})
