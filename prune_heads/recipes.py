"""YAML recipes: one file maps one-to-one onto the API calls of a pruning run.

Each section is a frozen dataclass; a recipe is validated on load against those classes, so an unknown
or misspelled key, a wrong type or a missing field is an error that names the key and the valid choices.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .config import CHOICES, RecoveryConfig, ScoringConfig, SelectionConfig
from .errors import ConfigError
from .evaluation.lm_eval import LmEvalConfig
from .evaluation.speed import SpeedConfig
from .scoring.methods import METHODS
from .task_data import DataConfig


class RegisteredNames(Collection[str]):
    """A registry's names, sorted, as they are when read: a method registered after import is a choice too."""

    def __init__(self, registry: dict[str, Any]) -> None:
        self.registry = registry

    def __contains__(self, name: object) -> bool:
        return name in self.registry

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.registry))

    def __len__(self) -> int:
        return len(self.registry)


# what a recipe's fields may hold: the config's choices and the scoring methods registered when it is read
ALLOWED: dict[str, Collection[str]] = {**CHOICES, "scoring.method": RegisteredNames(METHODS)}

SHIPPED = Path(__file__).parent / "shipped_recipes"


class RecipeError(ConfigError):
    """A recipe that cannot be used; the message names the key and what would be valid."""


@dataclass(frozen=True)
class EvaluationConfig:
    """What is measured before and after; `speed: null` skips the speed measurement; `lm_eval` runs
    lm-evaluation-harness tasks on a causal LM (`ph.lm_eval`); `analysis` writes the heads page (analysis.html,
    `ph.analyze` on the unpruned model and the scoring data, the removed heads marked: two fisher passes more)."""

    metrics: list[str] = field(default_factory=lambda: ["accuracy"])
    speed: SpeedConfig | None = field(default_factory=SpeedConfig)
    lm_eval: LmEvalConfig | None = None
    analysis: bool = True


@dataclass(frozen=True)
class OutputConfig:
    """Where and how the pruned model is written: `format` safetensors (a transformers folder, `save_pruned`)
    or gguf (`save_gguf`: one GGUF file for llama.cpp, at `path` when it ends in .gguf, else as model.gguf in
    the run's folder); `gguf_type` is the type of the tensors written anew, or a llama.cpp file type for the
    whole file (see `save_gguf`)."""

    path: str | None = None
    format: str = "safetensors"
    gguf_type: str | None = None


@dataclass(frozen=True)
class Recipe:
    """A whole pruning run: model, data, scoring, selection, evaluation, output."""

    model: str
    selection: SelectionConfig
    data: DataConfig = field(default_factory=DataConfig)
    task: str = "classification"
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    output: str | OutputConfig | None = None  # a path, or an output section
    standalone: bool = False  # ph.save_pruned(standalone=True): loadable without prune_heads
    device: str | None = None
    dtype: str | None = None
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    @property
    def written(self) -> OutputConfig:
        """The output section (a bare path is an output in the default format)."""
        return self.output if isinstance(self.output, OutputConfig) else OutputConfig(path=self.output)


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is Any:
        return True
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    return (
        hint.__name__
        if isinstance(hint, type)
        else str(hint).replace("typing.", "").replace("prune_heads.recipes.", "")
    )


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise RecipeError(f"{where or 'the recipe'} must be a mapping of keys to values, not {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RecipeError(f"unknown key {where + '.' if where else ''}{key}: {hint}valid keys: {', '.join(fields)}")
    values = {}
    for name, f in fields.items():
        path = f"{where}.{name}" if where else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RecipeError(f"{path} is missing (a {_type_name(hints[name])})")
            continue
        value, hint = data[name], hints[name]
        nested = next(
            (h for h in (hint, *typing.get_args(hint)) if isinstance(h, type) and dataclasses.is_dataclass(h)), None
        )
        if nested is not None and isinstance(value, dict):
            value = _build(nested, value, path)
        elif not _type_ok(value, hint):
            raise RecipeError(f"{path} must be {_type_name(hint)}, not {value!r}")
        if path in ALLOWED and value is not None and value not in ALLOWED[path]:
            raise RecipeError(f"{path} is {value!r}; choose one of {', '.join(ALLOWED[path])}")
        values[name] = value
    return cls(**values)


def _set(data: dict, assignment: str) -> None:
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise RecipeError(f"--set takes key=value (for example selection.sparsity=0.5), not {assignment!r}")
    *parents, last = key.split(".")
    target = data
    for part in parents:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise RecipeError(f"--set {key}: {part} is not a section")
    target[last] = yaml.safe_load(raw) if raw else None


def shipped_recipes() -> dict[str, Path]:
    """The recipes shipped with the package, by name."""
    return {p.stem: p for p in sorted(SHIPPED.glob("*.yaml"))}


def recipe_path(name_or_path: str) -> Path:
    """A recipe file: a path, or the name of a shipped recipe."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_recipes()
    if name_or_path in shipped:
        return shipped[name_or_path]
    raise RecipeError(f"no recipe file or shipped recipe named {name_or_path!r}; shipped: {', '.join(sorted(shipped))}")


def parse_recipe(data: Any, overrides: Sequence[str] = ()) -> Recipe:
    """Validate a recipe given as a dict (after applying `key=value` overrides)."""
    data = dict(data) if isinstance(data, dict) else data
    for assignment in overrides:
        if isinstance(data, dict):
            _set(data, assignment)
    if isinstance(data, dict) and data.get("recovery") in (False, "off"):  # `recovery: off`: no recovery at all
        data["recovery"] = vars(RecoveryConfig.off())
    recipe = _build(Recipe, data, "")
    try:
        chosen = recipe.selection.one_budget()
    except ConfigError as error:
        raise RecipeError(str(error)) from None
    if chosen in ("flops", "kv_cache", "max_loss") and recipe.scoring.steps > 1:
        raise RecipeError(f"selection.{chosen} needs scoring.steps 1; iterative pruning takes selection.sparsity")
    if recipe.scoring.steps > 1 and recipe.recovery.enabled:
        raise RecipeError("scoring.steps > 1 prunes iteratively, which recovery cannot follow; set recovery: off")
    return recipe


def load_recipe(name_or_path: str, overrides: Sequence[str] = ()) -> Recipe:
    """Read, override and validate a recipe file (a path or a shipped recipe's name).

    Raises RecipeError for a corrupt file, an unknown key (naming the valid ones), a wrong type or a
    missing field.
    """
    path = recipe_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise RecipeError(f"{path} is not valid YAML{line}: {getattr(error, 'problem', error)}; fix the file") from None
    return parse_recipe(data, overrides)


def recipe_to_dict(recipe: Recipe) -> dict:
    """The recipe as plain data (what `parse_recipe` accepts)."""
    return dataclasses.asdict(recipe)
