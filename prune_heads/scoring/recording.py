"""What the unpruned model does on the calibration data, recorded while it is scored: per attention layer, the
mean and variance of every output-projection input channel (FLAP's statistics, An et al. 2024) and the
compact reference outputs that recovery matches."""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import nn

from ..model.hooks import Hook, hooks
from ..model.layers import AttentionLayer, find_attention, resolve
from ..runtime.memory import release_freed_memory
from ..runtime.parallel import sum_across
from .objective import Objective, frozen


def token_rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Token rows [tokens, features] of a [batch, seq, features] activation, padding (mask 0) dropped."""
    if mask is not None and x.dim() == 3 and mask.shape == x.shape[:2]:
        return x[mask.bool()]
    return x.reshape(-1, x.shape[-1])


class Recorder:
    """Hooks that watch forward passes of the unpruned model: per attention layer, the sum and squared sum
    over tokens of every output-projection input channel (padding left out), and per pass the compact
    reference outputs (`Objective.reference`, on the CPU). Use it around the scoring pass so the statistics
    cost no extra forward; `calls` tells whether it saw one plain pass per batch."""

    def __init__(self, model: nn.Module, layers: list[AttentionLayer], objective: Objective) -> None:
        self.model, self.layers, self.objective = model, layers, objective
        self.sums = [torch.zeros(l.num_heads * l.head_dim, dtype=torch.float64) for l in layers]
        self.squares = [torch.zeros(l.num_heads * l.head_dim, dtype=torch.float64) for l in layers]
        self.tokens = [0] * len(layers)
        self.targets: list = []
        self.calls = 0
        self._mask: torch.Tensor | None = None
        self._stack = ExitStack()

    def __enter__(self) -> Recorder:
        watch: list[Hook] = [(self.model, "forward_pre", self._inputs), (self.model, "forward", self._outputs)]
        watch += [(resolve(l.module, l.spec.o), "forward_pre", self._channels(i)) for i, l in enumerate(self.layers)]
        self._stack.enter_context(hooks(watch, with_kwargs=True))
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
            x = token_rows(args[0].detach(), self._mask).double().cpu()  # [tokens, heads * head_dim]
            self.sums[i] += x.sum(0)
            self.squares[i] += (x * x).sum(0)
            self.tokens[i] += x.shape[0]

        return hook

    def reduce(self) -> None:
        """Sum the statistics over data-parallel processes (a no-op in a single process)."""
        n = len(self.layers)
        summed = sum_across([*self.sums, *self.squares, torch.tensor(self.tokens, dtype=torch.float64)])
        self.sums, self.squares = summed[:n], summed[n : 2 * n]
        self.tokens = [int(t) for t in summed[-1].tolist()]

    def means(self) -> list[torch.Tensor]:
        """Per layer, each output-projection input channel's mean over the recorded tokens."""
        return [s / max(n, 1) for s, n in zip(self.sums, self.tokens)]

    def variances(self) -> list[torch.Tensor]:
        """Per layer, each output-projection input channel's variance over the recorded tokens."""
        return [(q / max(n, 1) - m * m).clamp(min=0) for q, n, m in zip(self.squares, self.tokens, self.means())]


@torch.no_grad()
def record(model: nn.Module, batches: list[dict], objective: Objective) -> Recorder:
    """A `Recorder` filled by one plain no-grad pass over the batches."""
    with frozen(model), Recorder(model, find_attention(model), objective) as recorder:
        for batch in batches:
            model(**batch)
            release_freed_memory()
    return recorder
