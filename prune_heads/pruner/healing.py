"""The flow's last recovery step, healing (`recovery.heal`): the pruned model distilled toward the unpruned one
over a budget of tokens, kept only where the held-out data says it helps. `heal_start` makes its teacher and
checks its checkpoints before any work; `heal` runs it once the plan is folded (`recovery/heal.py`)."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import PruneConfig
from ..errors import ConfigError
from ..recovery.generated import token_batches, writes_text
from ..recovery.heal import (
    CALIBRATION_SHARE,
    HealData,
    HealStart,
    Settings,
    check_checkpoints,
    check_fits,
    divergences,
    fingerprint,
    heal_data,
    heal_steps,
    require_rows,
    step_shape,
    train,
    write_text,
)
from ..recovery.holdout import one_standard_error
from ..runtime.devices import input_device
from ..runtime.ledger import Stage
from ..runtime.work import Pricer
from ..scoring.objective import Objective
from ..task_data import TaskData, with_targets
from .records import Bench, Run


@dataclass(frozen=True)
class Healed:
    """What healing did: the report's step, whether it was kept, and the seconds."""

    entry: dict[str, Any]
    kept: bool
    seconds: float


def heal_start(
    model: nn.Module,
    config: PruneConfig,
    batches: list[dict],
    heal_data: TaskData | Iterable[dict] | None,
    resume: bool,
    progress: bool,
) -> HealStart | None:
    """The heal's teacher and checks, before any scoring: None where `recovery.heal` is 0. Refused in one line:
    a model whose batches are not token ids or that has an encoder and a decoder, a budget below one batch, a
    corpus with no rows, a checkpoint folder of another run."""
    r = config.recovery
    if not r.heal:
        if resume:
            raise ConfigError("--resume continues a heal's checkpoints, and recovery.heal is 0; give --heal TOKENS")
        return None
    if not token_batches(batches) or getattr(model.config, "is_encoder_decoder", False):
        raise ConfigError(
            "recovery.heal trains on batches of token ids through one stack (a decoder or an encoder); this "
            "model or data is neither: give 0"
        )
    rows, positions = step_shape(batches)
    heal_steps(int(r.heal), rows, positions)
    corpus = require_rows(with_targets(heal_data), "the heal corpus (--heal-data)") if heal_data is not None else []
    if corpus and not token_batches(corpus):
        raise ConfigError("the heal corpus (--heal-data) is not token batches: load it as --data is loaded")
    found = fingerprint(model, repr(config), batches + corpus)
    folder = Path(r.heal_checkpoints) if r.heal_checkpoints is not None else None
    if folder is not None:
        check_checkpoints(folder, found, resume)
    elif resume:
        raise ConfigError("--resume needs the folder of the checkpoints to continue: give --heal-checkpoints")
    every = max(1, int(r.heal_every) // (rows * positions))
    check_fits(model, r.heal_rank)
    settings = Settings(config.scoring.seed, folder, every, resume, progress, r.heal_rank)
    return HealStart(copy.deepcopy(model).eval(), corpus, found, settings)


def heal(run: Run, bench: Bench, start: HealStart) -> Healed:
    """Distil the pruned model toward the teacher over `recovery.heal` tokens, then keep it only where held-out
    data says it helps (`_kept`), else put the weights back as they were; its work counted where spent."""
    tick, model, teacher, r = time.perf_counter(), run.model, start.teacher, run.config.recovery
    objective = Objective(model)
    general = run.general.heldout if run.general is not None else []
    before = _measured(run, bench, objective, teacher, general)
    writer = (
        write_text(teacher, run.config.scoring.seed, start.settings.folder, run.progress)
        if writes_text(model) and not start.corpus
        else None
    )
    data = heal_data(run.scoring, start.corpus, int(r.heal), not writes_text(model), writer)
    bench.tally.add(Stage.GENERATION, run.pricer.forward(data.written))
    kept_weights = {name: p.detach().cpu().clone() for name, p in model.state_dict().items()}
    judged = general or run.heldout
    check = (lambda: float(divergences(objective, teacher, model, judged).mean())) if judged else None
    trained = train(model, teacher, data, start.settings, start.fingerprint, check)
    bench.tally.add(Stage.HEALING, _training_work(model, run.pricer, data, r.heal_rank))
    bench.tally.add(Stage.HEALING, 2 * len(trained.checks) * run.pricer.forward(judged))
    after = _measured(run, bench, objective, teacher, general)
    why = _kept(before, after, run.general.source if run.general is not None else "")
    kept = why is None
    if not kept:
        with torch.no_grad():
            for name, value in model.state_dict().items():
                value.copy_(kept_weights[name])
    seconds = time.perf_counter() - tick
    entry = _entry(data, trained, before, after, kept, seconds)
    return Healed(entry if kept else {**entry, "why_not": why}, kept, seconds)


def _measured(
    run: Run, bench: Bench, objective: Objective, teacher: nn.Module, general: list[dict]
) -> dict[str, torch.Tensor]:
    """Per held-out example, the model's divergence from the teacher on the calibration's held-out text and the
    guard's (where there is one), each pass (the model's and the teacher's) counted for healing."""
    found = {}
    for name, batches in (("calibration", run.heldout), ("general", general)):
        if batches:
            found[name] = divergences(objective, teacher, run.model, batches)
            bench.tally.add(Stage.HEALING, 2 * run.pricer.forward(batches))
    return found


def _kept(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], source: str) -> str | None:
    """Why the healed model is not kept (None where it is): it must beat the un-healed one beyond one standard
    error on the guard's held-out text (`source`; the calibration's where there is none) and be no worse beyond
    one on the calibration's; kept without held-out data (holdout 0 applies every step)."""
    if not before:
        return None
    judged = "general" if "general" in before else "calibration"
    if one_standard_error({"unhealed": before[judged], "healed": after[judged]}) != "healed":
        text = source if judged == "general" else "the calibration's held-out text"
        return f"no better on {text} beyond one standard error"
    calibration = before.get("calibration")
    if (
        calibration is not None
        and one_standard_error({"healed": after["calibration"], "unhealed": calibration}) != "healed"
    ):
        return "worse on the calibration's held-out text beyond one standard error"
    return None


def _training_work(model: nn.Module, teacher_price: Pricer, data: HealData, rank: int) -> float:
    """FLOPs of the heal's steps: per position, the student's forward, its backward (twice a forward where every
    weight trains, once where adapters do: no weight gradients) and the teacher's forward."""
    first = {k: v.unsqueeze(0).to(input_device(model)) for k, v in data.rows[0].items() if k != "labels"}
    student = Pricer.of(model, first).per_position
    return data.tokens * ((2 if rank else 3) * student + teacher_price.per_position)


def _entry(
    data: HealData,
    trained: Any,
    before: dict[str, torch.Tensor],
    after: dict[str, torch.Tensor],
    kept: bool,
    seconds: float,
) -> dict[str, Any]:
    """The report's step: what was trained on, the loss, the held-out divergences before and after, and whether
    it was kept."""
    return {
        "step": "healing",
        "tokens": data.tokens,
        "steps": data.steps,
        "resumed_at_step": trained.resumed,
        "rows": {
            "calibration": data.calibration,
            "calibration_repeats": data.repeats,
            "written": sum(b["input_ids"].shape[0] for b in data.written),
            "corpus": data.corpus,
            "calibration_share": round(CALIBRATION_SHARE, 3),
        },
        "loss": {"first_tenth": round(trained.first_loss, 6), "last_tenth": round(trained.last_loss, 6)},
        "heldout_at_checkpoints": trained.checks,
        "heldout": {k: {"before": float(before[k].mean()), "after": float(after[k].mean())} for k in before},
        "kept": kept,
        "seconds": round(seconds, 3),
    }
