"""Healing: the pruned model distilled toward the unpruned one (the teacher) over a budget of tokens the user
sets (`recovery.heal`), after the closed-form flow, kept only where held-out data says it helps.

The loss is the divergence the flow judges by, computed on the fly from the teacher on each batch: forward KL
from its next-token distribution over the whole vocabulary at every position (a language model), KL on the
logits plus the labels' cross-entropy where the data has them (a classifier), 1 - cosine and the neighbour
divergence within the batch (an embedding model). transformers' Trainer runs the loop: AdamW, warm-up and a
cosine schedule, gradient clipping, bfloat16 autocast where the device multiplies it natively, checkpoints that
a resumed run continues to the same model, data-parallel processes through accelerate. Every kept weight
trains, in float32 master copies, and goes back to the model's dtype at the end.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError
from ..runtime.devices import input_device, native_bfloat16, to_device
from ..runtime.parallel import rank_and_size
from ..runtime.progress import library_bars, progress_bar
from ..scoring.objective import Objective, neighbour_divergence
from ..task_data import DataError, batch_size, without_labels
from .generated import written_batches
from .token_kl import token_kl

CALIBRATION_SHARE = 1 / 3  # of the rows trained on (shared/notes/heal-measurements.md: a third kept movie text)
WRITTEN_EPOCHS = 2  # each written sequence is trained on about twice: writing a token costs more than training it
LEARNING_RATE = 5e-5  # AdamW's peak rate on every weight (the measured check's)
ADAPTER_LEARNING_RATE = 2e-4  # on LoRA adapters (alpha = rank): peft's examples' rate, not measured here
TRAINING_BYTES = 16  # per weight trained whole: float32 master copy, gradient and Adam's two moments
WARMUP = 0.08  # share of the steps the rate warms up over, then cosine to zero
BETAS = (0.9, 0.95)
CLIP = 1.0  # gradient norm
SEED = 104729  # added to the run's seed: the heal's written text is neither the guard's nor a data-free run's
FINGERPRINT = "heal.json"  # in the checkpoint folder: which run its checkpoints belong to
WRITTEN = "written.pt"  # the written text, kept beside the checkpoints so a resumed run does not write it again
DONE = "complete"  # in a checkpoint folder once the Trainer has written all of it
Check = Callable[[], float]  # a held-out value of the model being healed


@dataclass(frozen=True)
class HealData:
    """What the heal trains on: its rows (1-D tensors each, padded to `length`), in batches of `batch` rows, for
    `steps` steps; how many rows came from each source (calibration rows counted once, `repeats` times in the
    rows) and the written batches (to count their writing)."""

    rows: list[dict]
    batch: int
    length: int
    steps: int
    calibration: int
    repeats: int
    written: list[dict]
    corpus: int

    @property
    def tokens(self) -> int:
        """Tokens trained on: positions of every step's batch (padding included), what the budget counts."""
        return self.steps * self.batch * self.length


def heal_steps(tokens: int, batch: int, length: int) -> int:
    """Steps of `batch` rows of `length` tokens within `tokens`; a budget below one batch, or a batch the
    data-parallel processes cannot share evenly, is refused."""
    processes = rank_and_size()[1]
    if batch % processes:
        raise ConfigError(
            f"recovery.heal shares each batch of {batch} rows among {processes} processes: give a batch size "
            f"(--batch-size) that {processes} divides"
        )
    if tokens < batch * length:
        raise ConfigError(
            f"recovery.heal is {tokens} tokens, below one batch ({batch} x {length} = {batch * length} tokens): "
            f"give at least {batch * length} (or 0 for no healing)"
        )
    return tokens // (batch * length)


def written_rows(steps: int, batch: int, others: int) -> int:
    """Rows of text the model writes for a heal of `steps` batches: the share the calibration leaves, each row
    trained on `WRITTEN_EPOCHS` times; none where a corpus (`others` rows) takes that share."""
    if others:
        return 0
    return math.ceil(steps * batch * (1 - CALIBRATION_SHARE) / WRITTEN_EPOCHS)


def rows_of(batches: list[dict], length: int, labels: bool) -> list[dict]:
    """Each example of `batches` as a row of its own on the CPU, padded on the right to `length` positions (the
    mask 0 there), its labels kept where `labels` and it has them (a classifier's, not a language model's)."""
    rows = []
    for batch in batches:
        kept = batch if labels else without_labels(batch)
        for i in range(batch_size(batch)):
            rows.append({k: _padded(v[i].cpu(), k, length) for k, v in kept.items() if torch.is_tensor(v)})
    return rows


def _padded(value: torch.Tensor, key: str, length: int) -> torch.Tensor:
    """A row's token tensor padded on the right to `length` (0s: a masked position), others as they are."""
    if value.dim() != 1 or key not in ("input_ids", "attention_mask", "token_type_ids"):
        return value
    return nn.functional.pad(value, (0, length - value.shape[0]))


def step_shape(batches: list[dict]) -> tuple[int, int]:
    """(rows, positions) of one heal step: the first batch's rows, and the longest sequence, which every row is
    padded to."""
    return batch_size(batches[0]), max(b["input_ids"].shape[-1] for b in batches)


def heal_data(
    calibration: list[dict],
    corpus: list[dict],
    tokens: int,
    labels: bool,
    write: Any,
) -> HealData:
    """The heal's rows: the calibration's (with a classifier's labels), then the user's corpus or, for a
    language model, `write(rows, length)`'s text, the calibration repeated to `CALIBRATION_SHARE` of the rows."""
    batch, length = step_shape(calibration)
    steps = heal_steps(tokens, batch, length)
    given = rows_of(corpus, length, labels)
    written = write(written_rows(steps, batch, len(given)), length) if write is not None else []
    others = given + rows_of(written, length, False)
    calib = rows_of(calibration, length, labels)
    repeats = max(1, round(len(others) * CALIBRATION_SHARE / ((1 - CALIBRATION_SHARE) * len(calib))))
    return HealData(calib * repeats + others, batch, length, steps, len(calib), repeats, written, len(given))


def write_text(teacher: nn.Module, seed: int, folder: Path | None, progress: bool):
    """A writer of `rows` sequences of `length` tokens by the teacher (the guard's writer, seeded apart), kept in
    `folder` where given so a resumed run reads them back instead of writing them again."""

    def write(rows: int, length: int) -> list[dict]:
        kept = folder / WRITTEN if folder is not None else None
        if kept is not None and kept.exists():
            return torch.load(kept)
        if not rows:
            return []
        batches = written_batches(teacher, rows, 64, length, seed + SEED, progress)
        batches = [without_labels(b) for b in batches]
        if kept is not None:
            _saved(kept, batches)
        return batches

    return write


def _saved(path: Path, value: Any) -> None:
    """`torch.save` beside `path`, then moved into place: a run killed while saving leaves no half-written file."""
    partial = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(value, partial)
    partial.replace(path)


def fingerprint(model: nn.Module, settings: str, batches: list[dict]) -> str:
    """What identifies a heal's run before any work: the model's weights (names, shapes, types and a sample of
    each tensor's values), the settings and the calibration batches' tokens."""
    digest = hashlib.sha256(settings.encode())
    for name, p in model.named_parameters():
        sample = p.detach().flatten()[:: max(1, p.numel() // 256)].double().sum().item()
        digest.update(f"{name}{tuple(p.shape)}{p.dtype}{sample:.6e}".encode())
    for batch in batches:
        for key in sorted(batch):
            if torch.is_tensor(batch[key]):
                digest.update(key.encode() + batch[key].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def check_checkpoints(folder: Path, found: str, resume: bool) -> None:
    """Refuse, before any work, a checkpoint folder the run cannot use: another run's (another model, config
    or data), one that holds checkpoints without `resume`, or `resume` with nothing to resume."""
    record = folder / FINGERPRINT
    if not record.exists():
        if resume:
            raise ConfigError(f"nothing to resume in {folder}: it holds no heal checkpoints; drop --resume")
        if folder.exists() and any(folder.iterdir()):
            raise ConfigError(f"{folder} is not empty and holds no heal checkpoints; give an empty or new folder")
        return
    if not resume:
        raise ConfigError(f"{folder} holds a heal's checkpoints: give --resume to continue that run, or another folder")
    if json.loads(record.read_text()).get("fingerprint") != found:
        raise ConfigError(
            f"{folder} holds the checkpoints of another run (another model, config or data): give that run's "
            "inputs, or another folder without --resume"
        )


def check_fits(model: nn.Module, rank: int) -> None:
    """Refuse, before any work, healing every weight where their float32 copies, gradients and Adam state
    (`TRAINING_BYTES` a weight) alone pass the device's memory: adapters (`rank`) then fit."""
    device = input_device(model)
    if rank or device.type not in ("cpu", "cuda"):
        return
    import psutil

    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    total = total or psutil.virtual_memory().total
    need = TRAINING_BYTES * sum(p.numel() for p in model.parameters())
    if need > total:
        raise ConfigError(
            f"healing every weight of this model takes about {need / 2**30:.0f} GiB for their float32 copies, "
            f"gradients and Adam state, more than the {total / 2**30:.0f} GiB of {device}: give --heal-rank 64 "
            "(LoRA adapters, merged back)"
        )


def heal_loss(objective: Objective, teacher: nn.Module, student: nn.Module, batch: dict) -> torch.Tensor:
    """The batch's mean distillation loss: the divergence from the teacher's outputs (the whole vocabulary's
    distribution per token), plus the labels' cross-entropy where a classifier's batch has them, plus, for an
    embedding model, the neighbour divergence among the batch's examples."""
    inputs = without_labels(batch)
    with torch.no_grad():
        taught = teacher(**inputs)
    outputs = student(**inputs)
    if getattr(outputs, "logits", None) is not None and outputs.logits.dim() == 3 and "labels" not in batch:
        return token_kl(outputs.logits, taught.logits, inputs.get("attention_mask"))  # a language model
    embedding = objective.embedding(taught, inputs)
    reference = embedding if embedding is not None else torch.log_softmax(taught.logits.float(), -1)
    loss = objective.divergence(outputs, inputs, reference).mean()
    if "labels" in batch and embedding is None:
        loss = loss + objective.value(outputs, batch, None).mean()
    student_embedding = objective.embedding(outputs, inputs)
    if student_embedding is not None:
        loss = loss + neighbour_divergence(reference, student_embedding).mean().to(loss)
    return loss


@dataclass(frozen=True)
class Settings:
    """How the heal trains: the seed, where checkpoints go and every how many steps, whether it resumes, whether
    bars show, and what trains (`rank` 0: every weight; else LoRA adapters of that rank, merged back)."""

    seed: int
    folder: Path | None
    every: int
    resume: bool
    progress: bool
    rank: int = 0


@dataclass(frozen=True)
class HealStart:
    """What a heal needs from the start of the run: the unpruned model (a copy, the teacher), the user's corpus
    (batches; none without one), the run's fingerprint for its checkpoints and how it trains."""

    teacher: nn.Module
    corpus: list[dict]
    fingerprint: str
    settings: Settings


@dataclass(frozen=True)
class Trained:
    """What training did: the step a resumed run took over from its checkpoint (0 for a run from the start), the
    mean loss of the first and last tenth of the steps and the held-out check at each checkpoint this run wrote."""

    resumed: int
    first_loss: float
    last_loss: float
    checks: list[float]


def train(
    student: nn.Module, teacher: nn.Module, data: HealData, settings: Settings, found: str, check: Check | None = None
) -> Trained:
    """Distil `student` toward `teacher` on `data` with transformers' Trainer, every weight in float32 (the model's
    dtype again after), checkpoints in `settings.folder` every `settings.every` steps (a temporary folder
    without one), `check` (a held-out value) measured at each and shown on the bar; the caller's random state,
    parameter flags and mode are left as they were."""
    dtypes = {name: p.dtype for name, p in student.named_parameters()}
    flags = [p.requires_grad for p in student.parameters()]
    folder = settings.folder or Path(tempfile.mkdtemp(prefix="prune-heads-heal-"))
    try:
        with _kept_random_state(), _unmarked(student), _trainable(student, settings) as trained_model:
            trained = _run_trainer(trained_model, teacher, data, settings, folder, found, check)
    finally:
        for p, flag in zip(student.parameters(), flags):
            p.requires_grad_(flag)
        student.eval()
        if settings.folder is None:
            shutil.rmtree(folder, ignore_errors=True)
    assert all(p.dtype == dtypes[name] for name, p in student.named_parameters())
    return trained


@contextmanager
def _trainable(model: nn.Module, settings: Settings) -> Iterator[nn.Module]:
    """What the Trainer trains: the model itself, every weight in float32 master copies (`settings.rank` 0), or
    peft's LoRA adapters of that rank on every linear layer but the output layer (seeded), merged into the
    weights on the way out."""
    if not settings.rank:
        with _float32(model):
            model.requires_grad_(True)
            yield model
        return
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(settings.seed)  # the adapters' initial values (inside the kept random state)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.rank, target_modules="all-linear", lora_dropout=0.0)
    adapted = get_peft_model(model, config)
    try:
        yield adapted
    except BaseException:
        adapted.unload()  # the model as it was: nothing half-merged
        raise
    adapted.merge_and_unload()


@contextmanager
def _unmarked(model: nn.Module) -> Iterator[None]:
    """A model transformers read from a GGUF file holds plain weights but stays marked quantized, which the
    Trainer refuses to train or save: unmarked inside, marked again on exit (other quantizers are left alone)."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is None or getattr(method, "value", method) != "gguf":
        yield
        return
    marked: Any = model  # a transformers model: its marks are plain attributes
    marks = (marked.is_quantized, marked.config.__dict__.pop("quantization_config", None))
    marked.is_quantized, marked.hf_quantizer = False, None
    try:
        yield
    finally:
        marked.is_quantized, marked.hf_quantizer = marks[0], quantizer
        if marks[1] is not None:
            marked.config.quantization_config = marks[1]


@contextmanager
def _float32(model: nn.Module) -> Iterator[None]:
    """Every parameter in float32 inside (master weights for small updates), its own dtype again on exit."""
    dtypes = [p.dtype for p in model.parameters()]
    for p in model.parameters():
        p.data = p.data.float()
    try:
        yield
    finally:
        for p, dtype in zip(model.parameters(), dtypes):
            p.data = p.data.to(dtype)


@contextmanager
def _kept_random_state() -> Iterator[None]:
    """The process's random generators (torch's, numpy's, Python's) as they were on exit: the Trainer seeds them."""
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def _run_trainer(
    student: nn.Module,
    teacher: nn.Module,
    data: HealData,
    settings: Settings,
    folder: Path,
    found: str,
    check: Check | None,
) -> Trained:
    """The Trainer's run from the latest complete checkpoint (where resuming) to the last step."""
    from transformers import Trainer

    objective = Objective(student)
    losses: list[float] = []

    class Distiller(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = heal_loss(objective, teacher, model, inputs)
            return (loss, None) if return_outputs else loss

    args = _arguments(data, settings, folder, input_device(student))
    checks: list[float] = []
    callback = _progress(data, settings.progress, folder, losses, _checked(student, check, checks))
    trainer = Distiller(student, args, train_dataset=_Rows(data.rows), data_collator=_collate, callbacks=[callback])
    _drop_printer(trainer)
    last = _last_checkpoint(folder) if settings.resume else None
    resumed = int(last.name.split("-")[1]) if last is not None else 0
    (folder / FINGERPRINT).write_text(json.dumps({"fingerprint": found, "steps": data.steps}))
    teacher.eval()
    with library_bars(), _quiet_transformers():  # the Trainer's checkpoint writes show bars and notices
        trainer.train(resume_from_checkpoint=str(last) if last is not None else None)
    tenth = max(1, len(losses) // 10)
    return Trained(resumed, _mean(losses[:tenth]), _mean(losses[-tenth:]), checks)


def _checked(student: nn.Module, check: Check | None, checks: list[float]) -> Callable[[], str]:
    """The bar's held-out note after a checkpoint: `check` measured in eval mode, kept in `checks` ('' without)."""

    def note() -> str:
        if check is None:
            return ""
        student.eval()
        checks.append(check())
        student.train()
        return f"{checks[-1]:.4g}"

    return note


def _arguments(data: HealData, settings: Settings, folder: Path, device: torch.device) -> Any:
    """The Trainer's arguments: AdamW with warm-up and a cosine schedule over the heal's steps, clipping,
    bfloat16 autocast where the device multiplies it natively, a checkpoint every `settings.every` steps (the
    latest kept), a loss logged each step for our bar and nothing reported elsewhere."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(folder),
        max_steps=data.steps,
        per_device_train_batch_size=data.batch // rank_and_size()[1],  # data-parallel: each its share of a batch
        learning_rate=ADAPTER_LEARNING_RATE if settings.rank else LEARNING_RATE,
        lr_scheduler_type="cosine",
        warmup_steps=math.ceil(WARMUP * data.steps),
        weight_decay=0.0,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        max_grad_norm=CLIP,
        bf16=native_bfloat16(device),
        use_cpu=device.type == "cpu",
        save_strategy="steps",
        save_steps=settings.every,
        save_total_limit=1,
        logging_strategy="steps",
        logging_steps=1,
        seed=settings.seed,
        data_seed=settings.seed,
        report_to=[],
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
    )


def _progress(data: HealData, shown: bool, folder: Path, losses: list[float], note: Callable[[], str]) -> Any:
    """A Trainer callback: our bar (tokens a second, time left, the latest loss and held-out `note`), each step's
    loss into `losses`, and a mark in each checkpoint once the Trainer has written all of it."""
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        bar: Any = None
        shown: dict[str, str] = {}

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = progress_bar(None, "healing", data.steps, shown)
            self.bar.unit, self.bar.unit_scale = "tok", data.batch * data.length  # the bar counts tokens, not steps
            self.bar.update(state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))
                self.shown = {**self.shown, "loss": f"{logs['loss']:.4f}"}
                self.bar.set_postfix(self.shown)

        def on_step_end(self, args, state, control, **kwargs):
            self.bar.update()

        def on_save(self, args, state, control, **kwargs):
            (folder / f"checkpoint-{state.global_step}" / DONE).write_text("")
            held = note()
            if held:
                self.shown = {**self.shown, "held-out": held}
                self.bar.set_postfix(self.shown)

        def on_train_end(self, args, state, control, **kwargs):
            self.bar.close()

    return Progress()


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' own notices (checkpoint rotation, resuming) held back to errors inside."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _drop_printer(trainer: Any) -> None:
    """No Trainer lines on stdout (our bar says the loss), no Trainer bar (ours shows tokens)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)


def _last_checkpoint(folder: Path) -> Path | None:
    """The latest checkpoint the Trainer finished writing (one it was killed writing has no mark)."""
    done = [p for p in folder.glob("checkpoint-*") if (p / DONE).exists()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


class _Rows(torch.utils.data.Dataset):
    """The heal's rows as the Trainer's dataset."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


def _collate(rows: list[dict]) -> dict:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def divergences(objective: Objective, teacher: nn.Module, student: nn.Module, batches: list[dict]) -> torch.Tensor:
    """Per held-out example, the student's divergence from the teacher (the flow's held-out value), float64."""
    device = input_device(student)

    def runs():
        for batch in batches:
            inputs = to_device(without_labels(batch), device)
            with torch.no_grad():
                yield student(**inputs), inputs, objective.reference(teacher(**inputs), inputs)

    return objective.heldout(runs())


def require_rows(batches: list[dict], what: str) -> list[dict]:
    """`batches` where they hold at least one example, else one line naming the fix."""
    if not batches or not sum(map(batch_size, batches)):
        raise DataError(f"{what} has no examples after tokenization: give a file or split with text in it")
    return batches
