"""The command line's building blocks: option types, the options made from config fields, the recipe a
command's flags make, and how a command's errors and output reach the terminal."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..config import CHOICES, ScoringConfig, size_text
from ..errors import PruneHeadsError
from ..evaluation.report import frontier_table
from ..model.kv_sharing import SHARED
from ..model.surgery import PlanError
from ..recipes import parse_recipe
from ..runtime.memory import map_large_blocks


class _Budget(click.ParamType):
    """A number of passes, 0 or more, or 'none' for no limit."""

    name = "passes"

    def convert(self, value: Any, param: Any, ctx: Any) -> float | None:
        if value is None or str(value).lower() in ("none", "null"):
            return None
        try:
            number = float(value)
        except ValueError:
            self.fail(f"{value!r} is not a number of passes or 'none'", param, ctx)
        if number < 0:
            self.fail(f"{value} is below 0; give 0 or more passes, or 'none' for no limit", param, ctx)
        return number


BUDGET = _Budget()
OWN_PROCESS = "own_process"  # the click context's key: the command runs in a process of its own (`entry`)


def _fail(message: str, code: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def handle_errors(command: Callable) -> Callable:
    """A command's body: input the user must fix (`PruneHeadsError`) is one line and exit 2 (with its
    traceback under --traceback); anything else is a bug and shows its traceback. In the `prune-heads`
    process itself (`entry`), the C allocator is set up first (`map_large_blocks`), only once a command runs."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        if (click.get_current_context().find_root().obj or {}).get(OWN_PROCESS):
            map_large_blocks()
        try:
            return command(*args, **kwargs)
        except PruneHeadsError as error:
            if click.get_current_context().find_root().params.get("traceback"):
                raise
            _fail(str(error).splitlines()[0] if str(error) else type(error).__name__, 2)

    return wrapper


def processes_option(verb: str) -> Callable:
    """`--processes N`: the command data-parallel on N processes."""
    return click.option(
        "--processes",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help=f"{verb} data-parallel on this many processes (accelerate launch: one per GPU, else CPU over gloo).",
    )


def _devices() -> tuple[int, str]:
    """The devices data-parallel processes take one each of: GPUs where there are, else CPU cores."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count(), "GPUs"
    return os.cpu_count() or 1, "CPU cores"


def launched(processes: int) -> Any:
    """accelerate's state where this process is one of several; with `processes` > 1 outside such a launch,
    the command run again on that many processes (this one exits with their code). More processes than
    devices (GPUs, else CPU cores) is refused."""
    from ..runtime.parallel import distributed, relaunch

    state = distributed()
    if processes > 1 and state is None:
        devices, kind = _devices()
        if processes > devices:
            raise click.UsageError(
                f"--processes {processes} is more than the {devices} {kind} here: give at most {devices}"
            )
        sys.exit(relaunch(processes, without_option(sys.argv[1:], "--processes")))
    return state


def without_option(args: list[str], name: str) -> list[str]:
    """`args` without `name VALUE` or `name=VALUE`."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            kept.append(arg)
    return kept


def emit(data: Any, as_json: bool, text: Callable[[], str]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=1, default=float))
    else:
        click.echo(text())


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


class Registered(click.Choice):
    """A choice among a registry's names as they are when the command runs, so a method a user registers before
    calling the CLI is one of them (a plain Choice would freeze the names at import)."""

    def __init__(self, registry: dict) -> None:
        self.registry = registry
        super().__init__(sorted(registry))

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(sorted(self.registry))

    @choices.setter
    def choices(self, value: Any) -> None:  # click sets them once; the registry holds them
        pass


def config_option(config: type, name: str, **kwargs: Any) -> Callable:
    """The option of a config field: its flag (`--NAME`, `--NAME/--no-NAME` for a switch, or the field's own
    `flag`), its default and its documentation, all from the config (`prune_heads.config.option`)."""
    spec = next(f for f in dataclasses.fields(config) if f.name == name)
    flag = spec.metadata["flag"] or "--" + name.replace("_", "-")
    switch = isinstance(spec.default, bool) and not kwargs.get("is_flag")
    decls = (f"{flag}/--no-{flag[2:]}" if switch else flag, name)  # the parameter is named after the field
    default = kwargs.pop("default", spec.default if spec.default is not dataclasses.MISSING else None)
    show = default is not None and default is not False
    return click.option(*decls, default=default, show_default=show, help=spec.metadata["help"], **kwargs)


GGUF_TYPE_HELP = (
    "Lower case: the GGUF type of the tensors written anew (default: the source's; f16 from Hugging Face "
    "weights). Upper case (Q8_0, Q4_K_M, Q5_K_M, ...): the whole file quantized by llama.cpp's own quantizer."
)


def data_options(command: Callable) -> Callable:
    """Options that describe the model's task data (see ph.load_task_data)."""
    options = [
        click.option(
            "--data",
            "source",
            default=None,
            help="Dataset: hub name, file (csv/json/jsonl/parquet/txt) or folder of split files.",
        ),
        click.option(
            "--gguf-file",
            default=None,
            help="GGUF file inside MODEL's folder (or hub repo) to load (dequantized; saved as safetensors).",
        ),
        click.option("--task", default="classification", show_default=True, type=click.Choice(CHOICES["task"])),
        click.option("--split", default="validation", show_default=True, help="Split to use, e.g. 'train[:2048]'."),
        click.option("--text-column", default="sentence", show_default=True),
        click.option("--text-pair-column", default=None),
        click.option("--label-column", default="label", show_default=True),
        click.option("--examples", type=click.IntRange(min=1), default=None, help="Use at most this many examples."),
        click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True),
        click.option("--max-length", type=click.IntRange(min=2), default=128, show_default=True),
        click.option("--device", default=None, help="cpu, cuda, cuda:1, ... (default: where the model loads)."),
        click.option(
            "--dtype",
            default=None,
            type=click.Choice(CHOICES["dtype"]),
            help="Weights' type (default: as stored; a quantized GGUF file in bfloat16 where the device multiplies "
            "it natively, else float32).",
        ),
        config_option(ScoringConfig, "seed", type=int),
        click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout; logs go to stderr."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def make_recipe(model: str, opts: dict[str, Any], needs_data: bool = True, labels: bool = False, **sections: Any):
    """The recipe a command's flags make: the model, task, device and data flags in `opts`, then each section
    the command sets (`selection=`, `scoring=`, `recovery=`, `evaluation=`, `output=`, `data=`, `standalone=`)
    over the flags' own, key by key (a selection replaces the default, which removes nothing). `labels` keeps
    the label column of an embedding model's data; `needs_data` refuses a command without --data."""
    if needs_data and not opts["source"]:
        raise click.UsageError("--data is required (a dataset: hub name, file or folder of split files)")
    raw = _flag_sections(model, opts, labels)
    for name, value in sections.items():
        raw[name] = {**raw[name], **value} if isinstance(raw.get(name), dict) and isinstance(value, dict) else value
    raw.setdefault("selection", {"sparsity": 0.0})
    return parse_recipe(raw)


def _flag_sections(model: str, opts: dict[str, Any], labels: bool) -> dict[str, Any]:
    """The recipe sections the common flags (`data_options`) set."""
    task = opts["task"]
    return {
        "model": model,
        "task": task,
        "device": opts["device"],
        "dtype": opts["dtype"],
        "model_kwargs": {"gguf_file": opts["gguf_file"]} if opts["gguf_file"] else {},
        "data": {
            "source": opts["source"],
            "score_split": opts["split"],
            "text_column": opts["text_column"],
            "text_pair_column": opts["text_pair_column"],
            "label_column": None if task == "feature-extraction" and not labels else opts["label_column"],
            "max_length": opts["max_length"],
            "batch_size": opts["batch_size"],
            "score_examples": opts["examples"],
            "eval_examples": opts["examples"],
        },
        "scoring": {"seed": opts["seed"]},
        "recovery": {},
        "evaluation": {"metrics": task_metrics(task, ("accuracy",)), "speed": None, "lm_eval": None},
    }


def task_metrics(task: str, metrics: tuple[str, ...]) -> list[str]:
    """The `evaluate` metrics asked for, none for tasks measured otherwise (perplexity, embeddings)."""
    return [] if task in ("causal-lm", "feature-extraction") else list(metrics)


def read_plan(path: str) -> dict:
    """A plan JSON file: an object {layer: [heads]}, its shared KV heads under "shared_kv_heads"; anything else is a
    PlanError naming the file."""
    try:
        plan = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise PlanError(
            f"{path} is not valid JSON ({error.msg} at line {error.lineno}); a plan is "
            f'{{"layer name or index": [heads to remove]}}'
        ) from None
    if not isinstance(plan, dict) or not all(isinstance(v, list) for k, v in plan.items() if k != SHARED):
        raise PlanError(
            f'{path} must hold a JSON object {{"layer name or index": [heads to remove]}}, not {type(plan).__name__}'
        )
    sharing = plan.get(SHARED, {})
    if not isinstance(sharing, dict) or not all(isinstance(v, dict) for v in sharing.values()):
        raise PlanError(f'{path}: "{SHARED}" must hold {{"layer name or index": {{"merged KV head": kept KV head}}}}')
    return plan


def config_fields(config: type, opts: dict[str, Any]) -> dict[str, Any]:
    """The options of `config`'s fields among a command's options (each named after its field)."""
    return {f.name: opts[f.name] for f in dataclasses.fields(config) if f.name in opts}


def heldout_line(report) -> str:
    """What the held-out calibration data measured: the pruned model's divergence from the unpruned one,
    beside the plain selection's, and a language model's perplexity change there (a classifier's on its labels,
    under a loss bound)."""
    heldout = report.meta.get("heldout") or {}
    if heldout.get("final") is None:
        return ""
    final, plain = heldout["final"], heldout["plain"]
    change, general = heldout.get("perplexity_change"), heldout.get("general_perplexity_change")
    labels = " label" if report.meta.get("task") == "classification" else ""
    perplexity = "" if change is None else f"; held-out{labels} perplexity {100 * change:+.1f}%"
    if general is not None:
        perplexity += f", on {heldout['general']['source']} {100 * general:+.1f}%"
    return f" (held-out divergence from the unpruned model {final:.4g}; the plain selection's {plain:.4g}{perplexity})"


def heal_line(report) -> str:
    """What the heal did: its tokens, the guard's held-out divergence before and after, and whether it was kept."""
    entry = next((e for e in report.recovery if e["step"] == "healing"), None)
    if entry is None:
        return ""
    judged = entry["heldout"].get("general") or entry["heldout"].get("calibration")
    change = "" if judged is None else f", held-out divergence {judged['before']:.4g} -> {judged['after']:.4g}"
    return f"; healed on {entry['tokens']:,} tokens{change}" + (
        "" if entry["kept"] else f" (not kept: {entry['why_not']})"
    )


def asked_line(selection: dict, report) -> str:
    """A note when --round took another count than the one asked for."""
    if not selection.get("round") or report.meta.get("asked_heads") is None:
        return ""
    asked, removed = report.meta["asked_heads"], report.summary()["heads"]["removed"]
    return "" if asked == removed else f" (asked for {asked}; --round {selection['round']} took {removed})"


def calibration_line(report) -> str:
    """What the run calibrated on, where it wrote the text itself (no --data)."""
    written = report.meta.get("calibration")
    return "" if written is None else f"; calibrated on {written}, no --data"


def max_loss_line(report) -> str:
    """The depth a loss bound chose (KV heads shared or not), with the refitted rise it measured there."""
    depth = (report.meta.get("heldout") or {}).get("max_loss")
    if depth is None:
        return ""
    rise = dict((heads, value) for heads, value in depth["rises"]).get(depth["heads"], 0.0)  # 0 heads: none
    most = (
        "the deepest cut (KV heads shared where that measured better)"
        if report.meta.get("shared_kv_heads")
        else "the most"
    )
    return (
        f", {most} within --max-loss {100 * depth['bound']:g}% of {len(depth['rises'])} depths measured "
        f"(refitted, before tuning: {100 * rise:+.1f}%)"
    )


def frontier_lines(report, output: str) -> str:
    """The frontier's table under the prune line, where --depths asked for one, and where each depth's plan is
    (in an output folder)."""
    frontier = report.meta.get("frontier")
    if frontier is None:
        return ""
    table = "\n\n" + "\n".join(frontier_table(frontier))
    if output.endswith(".gguf"):  # one file out: no folder holds the plans
        return table
    return (
        f"{table}\n\neach depth's plan is in {output}/frontier/: --plan FILE with the same --data writes that "
        "depth, recovered as this one was, without scoring or the search"
    )


def kv_cache_line(report) -> str:
    """The pruned model's KV cache, where a KV-cache budget set the depth, and the KV heads it shares."""
    kv, shared = report.meta.get("kv_cache"), report.meta.get("shared_kv_heads", {})
    merged = sum(len(merges) for merges in shared.values())
    sharing = f", {merged} KV heads shared in {len(shared)} layers (their query heads kept)" if shared else ""
    if kv is None:
        return sharing
    return f"; its KV cache {size_text(kv['size'])} at {kv['context']:,} tokens ({kv['type']}){sharing}"
