"""What a pruning run does, as frozen dataclasses: `PruneConfig` for `ph.prune_model`, the same sections that
the YAML recipes and the CLI fill in. The defaults are the best path measured in benchmarks/."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConfigError
from .export.gguf import FILE_TYPES, GGUF_TYPES
from .recovery.generated import SHARE
from .recovery.search import ROUNDS
from .recovery.tuning import AVERAGE, MIN_TUNING_FLOPS
from .scoring.methods import METHODS
from .scoring.selection import GQA_MODES, GRANULARITIES, ROUNDING
from .task_data import TASKS

DTYPES = ("float32", "float16", "bfloat16")
FORMATS = ("safetensors", "gguf")  # a transformers folder, or one GGUF file for llama.cpp


@dataclass(frozen=True)
class ScoringConfig:
    """How heads are scored (`ph.score_heads`): `method` one of `ph.METHODS`; `steps` > 1 prunes iteratively
    (re-scoring after each step, Michel et al.); `objective` "auto" uses labels when the data has them,
    "label-free" the divergence from the unpruned model."""

    method: str = "fisher"
    steps: int = 1
    objective: str = "auto"
    normalize: bool | None = None
    seed: int = 0


@dataclass(frozen=True)
class SelectionConfig:
    """Which heads go (`ph.select_heads`): one budget (`sparsity`, `num_heads`, `keep_per_layer` or `flops`,
    the fraction of forward FLOPs to keep), and the constraints. A budget the structure cannot meet exactly
    is an error naming the nearest reachable values, unless `round` ("down" or "nearest") says to take one."""

    sparsity: float | None = None
    num_heads: int | None = None
    keep_per_layer: int | None = None
    flops: float | None = None
    scope: str = "global"
    min_heads_per_layer: int = 1
    gqa: str = "groups"
    uniform: bool = False
    granularity: str = "head"
    round: str | None = None
    ignore: list[str] = field(default_factory=list)

    def budget(self) -> dict:
        """The keyword arguments of `select_heads` this section sets (flops is resolved by the caller)."""
        return {k: v for k, v in vars(self).items() if k != "flops" and v is not None and v != []}


@dataclass(frozen=True)
class RecoveryConfig:
    """Retraining-free recovery, each step decided on held-out calibration data (`holdout` of the scoring
    batches, at least one batch, never the evaluation split): a step is kept only if it lowers the held-out
    divergence from the unpruned model by more than one standard error of the paired per-example differences
    (Breiman's rule: not on noise). `generated_share` adds text the unpruned model samples itself beside a decoder-only
    language model's calibration batches, that share of their examples (self-calibration,
    `prune_heads.recovery.generated`; `SHARE`, 3/8, is the share measured), so every step is fitted and checked
    on the model's own distribution as well as the user's domain; 0, the default, leaves it out: it moved the
    cost of pruning from the other domain to the user's on both models measured, a good trade on SmolLM2 and a
    poor one on Gemma 3, and nothing on held-out calibration data tells which (benchmarks/README.md). `rearrange`
    adds Kwon et al.'s Fisher-block selection and FLAP's fluctuation as candidate plans beside the plain one
    (and, with reconstruction, the structured-OBS plan and the searched plan: `search_rounds` rounds that each
    measure, on the first `search_examples` calibration examples (whole batches), the divergence when each KV
    group or head goes on top of the earlier rounds' removals with its reconstruction, and remove the cheapest
    share, `prune_heads.recovery.search`; None, the default, is 2 rounds where the model's outputs are per
    position (a language model's tokens) and none where each example gives one output (a class, a value, an
    embedding: there it never won), 0 rounds leave it out, and with a `tuning_budget` it is tried only when its
    counted work fits in what the recording and any written text left of it); `reconstruction` refits each
    pruned layer's output projection (its kept columns and bias) to the unpruned layer's output by ridge least
    squares, closed form from Gram matrices recorded while scoring, the ridge chosen per layer on the held-out
    tokens (`prune_heads.recovery.reconstruction`); without it, `bias_compensation` adds the removed heads' mean
    output to the output bias (FLAP, An et al. 2024; the reconstruction's limit); `gate_tuning` tunes one scale per
    kept head to the unpruned model's outputs, and `bias_tuning` the output biases with them, and
    `projection_tuning` a rank-`projection_rank` update of every output projection (LoRA's form, Hu et al. 2022,
    folded into the weights: it moves what the kept heads write, not only how loud each is), for at most
    `epochs` epochs, stopping when the held-out divergence stops falling (the default: the held-out data decides
    how much work depth needs), or, with a `tuning_budget`, before a step would take the recovery (recording
    statistics, trying candidates, tuning) past that many times the work of one forward and backward pass over
    the calibration batches (the default fisher scoring's cost); a capped tuning still gets at least
    `min_tuning_flops`, so small models tune fully, and a cut epoch is checked like a whole one. Work is counted
    in FLOPs from the model and the data (`prune_heads.runtime.work`), never timed: the same inputs, config and
    seed give the same model on any machine. Each check tries both the tuned values and their moving average
    over the steps (`average`, its decay per step; 0: the tuned values alone) and keeps the lower. Everything is
    tuned on the gated model (no copy of it) and folded into the weights. `holdout: 0` applies every enabled
    step without checking it (tuning then leaves the moving average)."""

    holdout: float = 0.2
    generated_share: float = 0.0
    rearrange: bool = True
    reconstruction: bool = True
    search_rounds: int | None = None
    search_examples: int = 24
    bias_compensation: bool = True
    gate_tuning: bool = True
    bias_tuning: bool = True
    projection_tuning: bool = True
    epochs: int = 4
    tuning_budget: float | None = None
    min_tuning_flops: float = MIN_TUNING_FLOPS
    gate_lr: float = 0.05
    bias_lr: float = 0.01
    projection_rank: int = 16
    projection_lr: float = 1e-3
    average: float = AVERAGE

    def __post_init__(self) -> None:
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


CHOICES: dict[str, tuple[str, ...]] = {
    "task": TASKS,
    "scoring.method": tuple(sorted(METHODS)),
    "scoring.objective": ("auto", "label-free"),
    "selection.scope": ("global", "layer"),
    "selection.gqa": GQA_MODES,
    "selection.granularity": GRANULARITIES,
    "selection.round": ROUNDING,
    "dtype": DTYPES,
    "output.format": FORMATS,
    "output.gguf_type": GGUF_TYPES + FILE_TYPES,
}
