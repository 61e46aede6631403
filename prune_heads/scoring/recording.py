"""What the unpruned model does on the calibration data, recorded while it is scored: per attention layer, the
mean and variance of every output-projection input channel (FLAP's statistics, An et al. 2024) and the
compact reference outputs that recovery matches."""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import nn

from ..model.hooks import Hook, hooks
from ..model.layers import AttentionLayer, find_attention, resolve
from ..model.onload import passes
from ..runtime.memory import release_freed_memory
from ..runtime.parallel import Shards, sum_across
from ..runtime.progress import progress_bar
from .objective import Objective, frozen


def token_rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Token rows [tokens, features] of a [batch, seq, features] activation, padding (mask 0) dropped."""
    if mask is not None and x.dim() == 3 and mask.shape == x.shape[:2]:
        return x[mask.bool()]
    return x.reshape(-1, x.shape[-1])


_PACKED: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}  # shared by layers


def _upper(width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The upper triangle's row and column indices on `device` (made there once, not sent with every batch; int32:
    half the bytes of the default)."""
    if (width, device) not in _PACKED:
        rows, cols = torch.triu_indices(width, width, device=device)
        _PACKED[width, device] = rows.int(), cols.int()
    return _PACKED[width, device]


class Moments:
    """Sums over tokens of x~ x~^T for x~ = [x, 1] (x: one layer's output-projection input): the Gram matrix,
    whose last row holds the sums of x and the token count. Kept as its upper triangle, in float64 (float32 for
    a half-precision model: a fixed share of the weights either way), or with `full=False` as its diagonal and
    last column alone (FLAP's means and variances, what scoring by fluctuation needs). The sums stay in CPU
    memory; `device` is where the tokens came from, where the algebra on them runs (an accelerator's float64
    solves are many times the CPU's)."""

    def __init__(self, width: int, full: bool, dtype: torch.dtype = torch.float64) -> None:
        self.width, self.full = width + 1, full
        size = self.width * (self.width + 1) // 2 if full else 2 * width
        self.values = torch.zeros(size, dtype=dtype)
        self.tokens = 0
        self.device = torch.device("cpu")

    def add(self, x: torch.Tensor) -> None:
        """Add the token rows x [tokens, width]."""
        x = x.double()
        self.tokens += x.shape[0]
        self.device = x.device
        if self.full:
            x = torch.cat([x, x.new_ones(x.shape[0], 1)], 1)
            rows, cols = _upper(self.width, x.device)
            self.values += (x.T @ x)[rows, cols].to(self.values)
        else:
            self.values += torch.cat([x.sum(0), (x * x).sum(0)]).to(self.values)

    def matrix(self) -> torch.Tensor:
        """The Gram matrix [width + 1, width + 1] of [x, 1], float64, on `device` (needs full=True)."""
        rows, cols = _upper(self.width, self.device)
        gram = torch.zeros(self.width, self.width, dtype=torch.float64, device=self.device)
        gram[rows.long(), cols.long()] = self.values.to(self.device).double()
        return gram + gram.triu(1).T

    def means_and_squares(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each channel's mean over the tokens and the mean of its square."""
        n = max(self.tokens, 1)
        if self.full:
            gram = self.matrix().cpu()
            return gram[:-1, -1] / n, gram.diagonal()[:-1] / n
        sums, squares = self.values.double().chunk(2)
        return sums / n, squares / n


class Recorder:
    """Hooks that watch forward passes of the unpruned model: per attention layer, the `Moments` of the
    output-projection inputs over the tokens (padding left out; the whole Gram matrix with `gram`, which
    reconstruction fits on), and per pass the compact reference outputs (`Objective.reference`, on the CPU).
    Use it around the scoring pass so the statistics cost no extra forward; `calls` tells whether it saw one
    plain pass per batch."""

    def __init__(
        self, model: nn.Module, layers: list[AttentionLayer], objective: Objective, gram: bool = False
    ) -> None:
        self.model, self.layers, self.objective = model, layers, objective
        half = any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())
        dtype = torch.float32 if half else torch.float64
        self.moments = [Moments(l.num_heads * l.head_dim, gram, dtype) for l in layers]
        self.targets: list = []
        self.calls = 0
        self._mask: torch.Tensor | None = None
        self._stack = ExitStack()

    def __enter__(self) -> Recorder:
        watch: list[Hook] = [(self.model, "forward_pre", self._inputs), (self.model, "forward", self._outputs)]
        watch += [(resolve(l.module, l.spec.o), "forward_pre", self._channels(i)) for i, l in enumerate(self.layers)]
        self._stack.enter_context(hooks(watch, with_kwargs=True, prepend=True))  # before any gate
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _inputs(self, module, args, kwargs) -> None:
        self._mask = kwargs.get("attention_mask")

    def _outputs(self, module, args, kwargs, outputs) -> None:
        self.calls += 1
        target = self.objective.reference(outputs, kwargs)
        self.targets.append(tuple(t.cpu() for t in target) if isinstance(target, tuple) else target.cpu())

    def _channels(self, i: int):
        def hook(module, args, kwargs) -> None:
            self.moments[i].add(token_rows(args[0].detach(), self._mask))  # [tokens, heads * head_dim]

        return hook

    def reduce(self) -> None:
        """The statistics summed over the data-parallel processes (a single process's unchanged)."""
        counts = torch.tensor([float(m.tokens) for m in self.moments])
        summed = sum_across([m.values for m in self.moments] + [counts])
        for moments, values, tokens in zip(self.moments, summed, summed[-1].tolist()):
            moments.values, moments.tokens = values.to(moments.values), int(tokens)

    def gather(self, shards: Shards) -> None:
        """After a pass over `shards.local`: the statistics summed (`reduce`) and the targets placed at their
        batches (None where this process ran no rows)."""
        self.reduce()
        self.targets = shards.spread(self.targets)

    def release_moments(self) -> None:
        """Drop the per-layer statistics (the Gram matrices: beside the model, the largest thing the flow
        holds) once nothing needs them; the reference outputs stay."""
        self.moments = []

    def means(self) -> list[torch.Tensor]:
        """Per layer, each output-projection input channel's mean over the recorded tokens."""
        return [m.means_and_squares()[0] for m in self.moments]

    def variances(self) -> list[torch.Tensor]:
        """Per layer, each output-projection input channel's variance over the recorded tokens."""
        return [(squares - mean * mean).clamp(min=0) for mean, squares in (m.means_and_squares() for m in self.moments)]


@torch.no_grad()
def record(
    model: nn.Module, batches: list[dict], objective: Objective, gram: bool = False, progress: bool = False
) -> Recorder:
    """A `Recorder` filled by one plain no-grad pass over the batches (layer-major where onloading proved it:
    `onload.passes`; a bar with `progress`)."""
    shards = Shards(batches)  # data-parallel: this process's rows, the statistics summed
    with frozen(model), Recorder(model, find_attention(model), objective, gram) as recorder:
        steps = passes(model, shards.local, lambda b: model(**b))
        for _ in progress_bar(steps, "recording", len(shards.local), progress):
            release_freed_memory()
    recorder.gather(shards)
    return recorder
