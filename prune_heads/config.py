"""What a pruning run does, as frozen dataclasses: `PruneConfig` for `ph.prune_model`, the same sections that
the YAML recipes and the CLI fill in. Each field carries its one line of documentation (`option`), the text of
`--help` and docs/cli-reference.md. The defaults are the best path measured in benchmarks/."""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from .errors import ConfigError
from .model.surgery import PlanError
from .task_data import TASKS

# The choices and defaults the config offers and the wings honour, here so that the config sits below the code it
# configures (scoring, recovery, export import them from it; it imports none of them).
DTYPES = ("float32", "float16", "bfloat16")
BUDGETS = ("sparsity", "num_heads", "keep_per_layer", "flops", "kv_cache", "max_loss")  # how many go: one of them
FRONTIER = ("depths", "context")  # what a frontier measures beside the budget, not how heads go
FORMATS = ("safetensors", "gguf")  # a transformers folder, or one GGUF file for llama.cpp
DEFAULT_METHOD = "fisher"  # the default path's, measured best in benchmarks/scoring.py
GQA_MODES = ("groups", "even")  # whole KV groups, or the same number of query heads from every group
GRANULARITIES = ("head", "layer")
ROUNDING = ("down", "nearest", "up")
GENERAL_MODES = ("report", "weigh", "off")
SHARE = 0.375  # written examples per calibration example, the share measured: 3 for every 8
# The default rounds of the plan search where the outputs are per position (a language model's tokens). Where
# each example gives one output (a class, a value, an embedding) the default runs none: on the classifier
# fixtures its plan lost on held-out data in every cell measured, even on 256 examples (benchmarks/research-log.md,
# the searched plan).
ROUNDS = 2
AVERAGE = 0.9  # decay per step of the moving average that tuning checks beside its last step
MIN_TUNING_FLOPS = 6e12  # tuning always gets this much work (about a minute on 2 CPU cores): small models tune fully
_BLOCKED = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")  # gguf-py's quantized types: blocks of 32 values
GGUF_TYPES = ("source", "f32", "f16", "bf16", *_BLOCKED)  # of tensors written anew
# whole-file types of llama.cpp's own quantizer (llama-quantize's names): the file is written, then quantized
FILE_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0", "Q3_K_M", "Q2_K")

# llama.cpp's KV-cache types (--cache-type-k / --cache-type-v): values per block, bytes per block
CACHE_TYPES = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q5_1": (32, 24),
    "q5_0": (32, 22),
    "q4_1": (32, 20),
    "iq4_nl": (32, 18),
    "q4_0": (32, 18),
}
UNITS = {"b": 1, "kb": 10**3, "kib": 2**10, "mb": 10**6, "mib": 2**20, "gb": 10**9, "gib": 2**30}
_FORM = "SIZE@TOKENS[:TYPE], e.g. 120MiB@8192 or 1GiB@32k:q8_0"


@dataclass(frozen=True)
class KvCacheBudget:
    """A KV cache of at most `size` bytes holding `context` tokens, each value in `cache_type`."""

    size: int
    context: int
    cache_type: str = "f16"

    @classmethod
    def parse(cls, text: str) -> KvCacheBudget:
        """`SIZE@TOKENS[:TYPE]`: a size with its unit (B, KB, KiB, MB, MiB, GB, GiB), a context length (a `k`
        suffix: thousands of 1,024) and one of llama.cpp's cache types (f16 by default)."""
        found = re.fullmatch(r"\s*([\d.]+)\s*([a-z]+)\s*@\s*(\d+)(k?)\s*(?::\s*(\w+))?\s*", text, re.IGNORECASE)
        unit = found and UNITS.get(found.group(2).lower())
        cache_type = (found and found.group(5) or "f16").lower()
        if not found or unit is None or cache_type not in CACHE_TYPES:
            raise PlanError(
                f"cannot read the KV-cache budget {text!r}: give {_FORM} (units {', '.join(_UNIT_NAMES)}; cache "
                f"types {', '.join(CACHE_TYPES)})"
            )
        size = math.floor(float(found.group(1)) * unit)
        context = int(found.group(3)) * (1024 if found.group(4) else 1)
        if size <= 0 or context <= 0:
            raise PlanError(f"the KV-cache budget {text!r} needs a size and a context length above 0")
        return cls(size, context, cache_type)

    def __str__(self) -> str:
        return f"{size_text(self.size)} at {self.context:,} tokens ({self.cache_type})"


_UNIT_NAMES = ("B", "KB", "KiB", "MB", "MiB", "GB", "GiB")


def size_text(size: float) -> str:
    """A size in the largest binary unit it reaches, as the KV-cache messages give it."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:,.2f} {unit}"
    return f"{size:,.0f} B"


def option(default: Any = None, help: str = "", *, flag: str | None = None, cli: bool = True, factory=None) -> Any:
    """A config field with its documentation: `help`, one line, is what `--help`, docs/cli-reference.md and
    the recipe docs say of it; `flag` is the `prune` command's option where its name is not the field's, and
    `cli=False` marks a field set only by recipes (`--set`) and the API."""
    metadata = {"help": help, "flag": flag, "cli": cli}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class ScoringConfig:
    """How heads are scored (`ph.score_heads`)."""

    method: str = option(DEFAULT_METHOD, "Scoring method: one in ph.METHODS, those `prune-heads score --help` lists.")
    steps: int = option(1, "More than 1: prune iteratively, re-scoring after each step (needs --no-recovery).")
    objective: str = option(
        "auto",
        "'auto' scores on the labels where the data has them; 'label-free' on the divergence from the unpruned model.",
        cli=False,
    )
    normalize: bool | None = option(None, "Normalize scores per layer (None: the method's own default).", cli=False)
    seed: int = option(0, "Seed of every random draw (scoring, written text, tuning's updates).")


@dataclass(frozen=True)
class SelectionConfig:
    """Which heads go (`ph.select_heads`): one budget and the constraints. A budget the structure cannot meet
    exactly is an error naming the nearest reachable values, unless `round` says which to take."""

    sparsity: float | None = option(None, "Fraction of all heads to remove.")
    num_heads: int | None = option(None, "Number of heads to remove.")
    keep_per_layer: int | None = option(None, "Heads every layer keeps.", cli=False)
    flops: float | None = option(
        None,
        "Remove heads until a forward pass costs at most this fraction of its FLOPs (at --max-length).",
        flag="--keep-flops",
    )
    kv_cache: str | None = option(
        None,
        "Remove the fewest KV groups that bring the KV cache within SIZE@TOKENS[:TYPE] (120MiB@8192, "
        "1GiB@32k:q8_0; llama.cpp's cache types, f16 by default), or share them where that measures better "
        "(--kv-sharing).",
    )
    max_loss: float | None = option(
        None,
        "Remove the most units (KV groups, heads or blocks) whose removal, each pruned layer refitted, raises a "
        "language model's held-out perplexity (a classifier's on its labels) by at most this many percent (the "
        "deepest prefix of one order: the search's, else the ranking's; KV groups measured shared too, "
        "--kv-sharing).",
    )
    depths: str | None = option(
        None,
        "Also measure these depths along the searched order, as shares of the heads ('1/6,1/3,1/2'): the held-out "
        "(and --eval-data) perplexity change with its interval, the KV cache and the parameters of each, in the "
        "report's frontier; the model written is the budget's (or --max-loss's) depth.",
    )
    context: int = option(
        8192, "Context length (tokens) the frontier's KV-cache sizes and llama.cpp speeds (GGUF out) are given at."
    )
    scope: str = option("global", "'global' ranks heads across layers; 'layer' removes the share from each layer.")
    min_heads_per_layer: int = option(1, "Heads every layer keeps at least (0 lets a layer lose them all).")
    gqa: str = option(
        "groups", "Grouped-query layers lose whole KV groups ('groups'), or the same number of heads from every group."
    )
    uniform: bool = option(False, "Every layer keeps the same number of heads (stock Llama configs).")
    granularity: str = option("head", "'layer' removes whole attention blocks (and their KV cache).")
    round: str | None = option(
        None,
        "When the structure cannot remove exactly what was asked, take the nearest reachable count "
        "(down, nearest or up) instead of stopping with an error; the report says what was removed.",
    )
    ignore: list[str] = option(help="Layers (name patterns) that keep every head.", cli=False, factory=list)

    def __post_init__(self) -> None:
        if self.kv_cache is not None:
            KvCacheBudget.parse(self.kv_cache)
        if self.max_loss is not None and not self.max_loss > 0:
            raise ConfigError(f"selection.max_loss is {self.max_loss}; give a percentage above 0 (3 for +3%)")
        if self.depths is not None:
            parse_depths(self.depths)
        if self.context < 1:
            raise ConfigError(f"selection.context is {self.context}; give a number of tokens above 0")

    def one_budget(self) -> str:
        """The one budget set (`BUDGETS`); two or none are refused, by the API, the CLI and recipes alike."""
        chosen = [k for k in BUDGETS if getattr(self, k) is not None]
        if len(chosen) != 1:
            raise ConfigError(
                f"selection needs exactly one of {', '.join(BUDGETS[:-1])} or {BUDGETS[-1]} (has {chosen or 'none'})"
            )
        return chosen[0]


def parse_depths(depths: str) -> list[float]:
    """`selection.depths` ('1/6,1/3,1/2') as shares of the heads, shallowest first (refused unless each is in
    (0, 1))."""
    try:
        found = sorted(float(Fraction(part.strip())) for part in str(depths).split(","))
    except (ValueError, ZeroDivisionError):
        found = []
    if not found or not all(0 < f < 1 for f in found):
        raise ConfigError(f"selection.depths is {depths!r}; give shares of the heads, e.g. '1/6,1/3,1/2'")
    return found


def parse_tokens(value: int | str, key: str = "a token count") -> int:
    """A token count (`key`'s): a whole number, or one with a k or M suffix ('250k', '2M', '1.5M')."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", str(value)) if not isinstance(value, bool) else None
    found = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6}[match.group(2).lower()] if match else -1.0
    if found < 0 or found != int(found):
        raise ConfigError(f"{key} is {value!r}; give a whole number of tokens such as 2000000, 250k or 2M")
    return int(found)


@dataclass(frozen=True)
class RecoveryConfig:
    """Retraining-free recovery after removal (docs/recovery.md). Each step is tried on held-out calibration
    data and kept only if it lowers the divergence from the unpruned model by more than one standard error
    of the paired per-example differences (Breiman's rule: not on noise). Work is counted in FLOPs, never
    timed: the same inputs, config and seed give the same model on any machine."""

    holdout: float = option(
        0.2, "Fraction of the calibration examples held out to decide recovery (0: apply every step)."
    )
    generated_share: float = option(
        0.0,
        "Text a decoder-only language model writes itself, added beside the calibration batches as this share of "
        f"their examples, so recovery also fits its own distribution (0, the default: none; {SHARE} is the share "
        "the benchmarks measured).",
    )
    general: str = option(
        "report",
        "A second held-out set, the model's own written text (or --eval-data): 'report' measures the pruned "
        "model's change on it beside the calibration's; 'weigh' also makes every decision weigh it, equally; "
        "'off' neither, for a model that serves the calibration's domain alone.",
    )
    rearrange: bool = option(
        True,
        "Also try the Fisher-block (Kwon), fluctuation (FLAP) and, with reconstruction, structured-OBS and "
        "searched plans.",
    )
    reconstruction: bool = option(
        True, "Try refitting each pruned layer's output projection and bias to its unpruned output (least squares)."
    )
    kv_sharing: bool = option(
        True,
        "Under a KV-cache budget or a loss bound, also try keeping the query heads of the KV groups the plan "
        "empties, re-pointed to a KV head it keeps (shared KV heads: the same cache), kept where it measures "
        "better on held-out data.",
    )
    search_rounds: int | None = option(
        None,
        "Rounds of the searched plan (each measures every KV group's or head's removal, refitted, on a few "
        f"calibration examples, and removes the cheapest share); 0: none; default: {ROUNDS} where the outputs "
        "are per token (language models), none where each example gives one (classifiers, embeddings).",
    )
    search_examples: int = option(
        24, "Calibration examples (whole batches) each search measurement runs on.", cli=False
    )
    search_screen: bool = option(
        True,
        "Screen each search round's units on a quarter of the search examples, then race the cheapest over the "
        "rest until each is clearly in or out (the same plan for less work); off: every unit on every example.",
    )
    bias_compensation: bool = option(
        True, "Without reconstruction: try adding the removed heads' mean output to the output bias (FLAP)."
    )
    gate_tuning: bool = option(True, "Tune one scale per kept head to the unpruned outputs.")
    bias_tuning: bool = option(True, "Tune the output biases with the gates.")
    projection_tuning: bool = option(True, "Tune a low-rank update of each output projection with them (LoRA's form).")
    epochs: int = option(4, "At most this many tuning epochs (stops early on held-out data).")
    tuning_budget: float | None = option(
        None,
        "Cap on the work of recovery (statistics, candidates, tuning), in forward+backward passes over the "
        "calibration data (counted, never timed); 'none': tune until the held-out divergence stops falling.",
    )
    min_tuning_flops: float = option(
        MIN_TUNING_FLOPS, "FLOPs tuning gets at least under a tuning_budget (small models tune fully).", cli=False
    )
    gate_lr: float = option(0.05, "Learning rate of the gates' scales.", cli=False)
    bias_lr: float = option(0.01, "Learning rate of the output biases.", cli=False)
    projection_rank: int = option(16, "Rank of each output projection's tuned update.", cli=False)
    projection_lr: float = option(1e-3, "Learning rate of the projection updates.", cli=False)
    average: float = option(
        AVERAGE, "Decay per step of the moving average of the tuned values each check also tries (0: none).", cli=False
    )
    heal: int | str = option(
        0,
        "Tokens of distillation from the unpruned model after the cut (2M, 250k; 0: none): every kept weight "
        "trained on the calibration text and, for a language model, its own written text (or --heal-data), kept "
        "only where held-out data improves.",
    )
    heal_rank: int = option(
        0,
        "What the heal trains: 0, every kept weight; R, LoRA adapters of rank R on every linear layer (peft), "
        "merged back (for a model whose every weight's Adam state does not fit).",
    )
    heal_every: int | str = option(
        "100k", "Tokens between the heal's checkpoints (--heal-checkpoints), which --resume continues from."
    )
    heal_checkpoints: str | None = option(
        None,
        "Folder for the heal's checkpoints (default with -o: OUTPUT.heal, removed once the model is written); "
        "--resume continues the run whose checkpoints it holds.",
    )

    def __post_init__(self) -> None:
        for key in ("heal", "heal_every"):  # '2M' in a recipe or on the command line
            object.__setattr__(self, key, parse_tokens(getattr(self, key), f"recovery.{key}"))
        if self.heal and not self.enabled:
            raise ConfigError(
                f"recovery.heal is {self.heal} tokens, but recovery is off and healing is its last step; turn "
                "recovery on (drop --no-recovery) or give 0"
            )
        if self.heal_rank < 0:
            raise ConfigError(f"recovery.heal_rank is {self.heal_rank}; give 0 (every weight) or a LoRA rank above 0")
        if int(self.heal_every) < 1:
            raise ConfigError(f"recovery.heal_every is {self.heal_every}; give a number of tokens above 0")
        if self.tuning_budget is not None and self.tuning_budget < 0 or self.min_tuning_flops < 0:
            raise ConfigError(
                f"recovery.tuning_budget is {self.tuning_budget} and recovery.min_tuning_flops "
                f"{self.min_tuning_flops}; give 0 or more (tuning_budget: null for no limit)"
            )
        for key in ("holdout", "average"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(
                    f"recovery.{key} is {getattr(self, key)}; give a value from 0 up to (not including) 1"
                )
        if self.generated_share < 0:
            raise ConfigError(
                f"recovery.generated_share is {self.generated_share}; give 0 or more (0: none; {SHARE} is the "
                "share measured for a decoder-only language model)"
            )
        if self.generated_share and not self.enabled:
            raise ConfigError(
                f"recovery.generated_share is {self.generated_share}, but recovery is off and only recovery "
                "uses the written text; turn recovery on (drop --no-recovery, or a recipe's recovery: off) or give 0"
            )
        if self.general not in GENERAL_MODES:
            raise ConfigError(f"recovery.general is {self.general!r}; give one of {', '.join(GENERAL_MODES)}")
        if self.epochs < 0:
            raise ConfigError(f"recovery.epochs is {self.epochs}; give 0 or more")
        if self.projection_rank < 1:
            raise ConfigError(f"recovery.projection_rank is {self.projection_rank}; give 1 or more")
        if (self.search_rounds or 0) < 0 or self.search_examples < 1:
            key = "search_examples" if self.search_examples < 1 else "search_rounds"
            raise ConfigError(
                f"recovery.{key} is {getattr(self, key)}; give 0 or more search_rounds (0: no searched plan; "
                f"null: {ROUNDS} where the outputs are per token) and 1 or more search_examples"
            )

    @classmethod
    def off(cls) -> RecoveryConfig:
        """No recovery: the plain selection, pruned as it is."""
        return cls(
            rearrange=False,
            reconstruction=False,
            bias_compensation=False,
            gate_tuning=False,
            bias_tuning=False,
            projection_tuning=False,
        )

    @property
    def enabled(self) -> bool:
        """Whether any recovery step is on."""
        return self.rearrange or self.reconstruction or self.bias_compensation or self.tuning

    @property
    def tuning(self) -> bool:
        """Whether anything is tuned (gates, biases or projection updates)."""
        return self.gate_tuning or self.bias_tuning or self.projection_tuning


@dataclass(frozen=True)
class PruneConfig:
    """A whole `ph.prune_model` run: scoring, selection and recovery. `PruneConfig(selection=
    SelectionConfig(sparsity=0.5))` is the default path; a recipe builds one with `from_recipe`."""

    selection: SelectionConfig = field(default_factory=lambda: SelectionConfig(sparsity=0.5))
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)

    @classmethod
    def from_recipe(cls, recipe) -> PruneConfig:
        """The scoring, selection and recovery sections of a `Recipe`."""
        return cls(selection=recipe.selection, scoring=recipe.scoring, recovery=recipe.recovery)


CHOICES: dict[str, Collection[str]] = {
    "task": TASKS,
    "scoring.objective": ("auto", "label-free"),
    "selection.scope": ("global", "layer"),
    "recovery.general": GENERAL_MODES,
    "selection.gqa": GQA_MODES,
    "selection.granularity": GRANULARITIES,
    "selection.round": ROUNDING,
    "dtype": DTYPES,
    "output.format": FORMATS,
    "output.gguf_type": GGUF_TYPES + FILE_TYPES,
}
