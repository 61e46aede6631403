"""The general-ability guard: a second held-out set beside the calibration's own held-out text, so a model
pruned on text of one domain does not spend what it does elsewhere unseen. By default the flow reports the
pruned model's change on it ('report'); with 'weigh' every decision weighs it too. For a language model it
is text the unpruned model writes itself (seeded, as a run without data writes its calibration: a sample of
what the model does in general); the user's `eval_data` in its place where given. It is only judged on, never
fitted: the refits and tuning fit the calibration alone (`recovery.generated_share` is what fits on written
text)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from ..task_data import DataError, TaskData, batch_size, with_targets
from .generated import start_token, token_batches, writes_text, written_batches
from .search import first_examples

# 'report' by default: weighed, the written text led Gemma 3's decisions away from both test texts
# (benchmarks/research-log.md, the general-ability guard)
SHARE = 0.5  # written examples per calibration example in each set measured: a measurement costs 1.5x
SEED = 7919  # added to the run's seed, so the guard's text is never the one a run without data calibrates on
WRITTEN = "the model's own text"
GIVEN = "eval_data"
OFF = (
    "general-ability guard off: this model writes no text; give eval_data (--eval-data) with the task's labels "
    "to judge on a second text"
)


@dataclass(frozen=True)
class General:
    """The guard's text: the batches the search measures beside its calibration batches (`search`, the i-th
    beside the i-th), the held-out batches every other decision measures (`heldout`, with their labels) and
    where they come from (`source`: the model's own text, or eval_data)."""

    search: list[dict]
    heldout: list[dict]
    source: str

    @property
    def written(self) -> list[dict]:
        """The batches the model wrote (none where they are eval_data's)."""
        return self.search + self.heldout if self.source == WRITTEN else []


def general_text(
    model: nn.Module,
    calib: list[dict],
    heldout: list[dict],
    eval_data: TaskData | Iterable[dict] | None,
    search_examples: int,
    seed: int,
    progress: bool = True,
) -> tuple[General | None, str | None]:
    """The guard's text for this run, or None and why: `eval_data` where given (it needs labels: a language
    model's next tokens or the task's classes), else what a decoder-only language model writes itself, as many
    examples as `SHARE` of the held-out ones and of the search's first `search_examples`."""
    given = with_targets(eval_data) if eval_data is not None else []
    if given:
        if not all("labels" in b for b in given):
            raise DataError(
                "eval_data (--eval-data) is the second held-out set every decision weighs, and its batches have "
                "no labels: load it as the task is loaded (a causal-lm task's text, a classifier's labels)"
            )
        return _split(given, len(first_examples(calib, search_examples))), None
    if not (writes_text(model) and start_token(model) is not None and token_batches(calib)):
        return None, OFF
    return _written(model, calib, heldout, search_examples, seed, progress), None


def _written(
    model: nn.Module, calib: list[dict], heldout: list[dict], search_examples: int, seed: int, progress: bool
) -> General:
    """Text the model writes: one batch beside each of the search's calibration batches, `SHARE` as many rows,
    and `SHARE` as many held-out examples as the held-out batches hold, each as long as the calibration's."""
    searched = len(first_examples(calib, search_examples))
    length = _width(calib)
    rows = math.ceil(SHARE * batch_size(calib[0]))
    search = written_batches(model, rows * searched, rows, length, seed + SEED, progress) if searched else []
    examples = math.ceil(SHARE * sum(batch_size(b) for b in heldout))
    held = written_batches(model, examples, batch_size(calib[0]), length, seed + 2 * SEED, progress)
    return General(search, held, WRITTEN)


def _split(given: list[dict], searched: int) -> General:
    """`eval_data`'s batches: the first (at most one per search batch, at most half of them) beside the search's,
    the rest held out."""
    count = min(searched, len(given) // 2)
    return General(given[:count], given[count:], GIVEN)


def _width(batches: list[dict]) -> int:
    """The longest calibration sequence (token positions)."""
    return max(b["input_ids"].shape[-1] for b in batches)
