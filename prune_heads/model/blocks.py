"""Forward passes that start part-way through the model. Where every attention layer lies in one chain of
blocks (one `nn.ModuleList` the model runs in order, each block's output the next one's input: every
decoder-only language model), what the block before block j returned is kept per batch, and in a later pass
the blocks before j return it instead of running: a change at or after block j is then measured for the price
of the blocks from j on. The embeddings, masks and position tables are still made by the model as usual, so no
family's forward is written again here. A model whose forward does not fit the chain (blocks that pass
anything else along, or change what they are given) is caught by `Resume.proven`, which compares the two ways
on the model itself, bit for bit."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from typing import Any

import torch
from torch import nn

from .hooks import hooks
from .layers import AttentionLayer


class _Stop(Exception):
    """Ends a pass once the kept outputs are made (the blocks after them are not needed)."""


def block_chain(model: nn.Module, layers: list[AttentionLayer]) -> tuple[nn.ModuleList, list[int]] | None:
    """The `nn.ModuleList` whose blocks hold every attention layer (the outermost list on each layer's path)
    and each layer's block in it, or None where the layers lie in more than one list (an encoder and a
    decoder) or in none."""
    modules = dict(model.named_modules())
    found: set[str] = set()
    index: list[int] = []
    for layer in layers:
        parts = layer.name.split(".")
        lists = [k for k in range(1, len(parts)) if isinstance(modules.get(".".join(parts[:k])), nn.ModuleList)]
        at = next((k for k in lists if parts[k].isdigit()), None)
        if at is None:
            return None
        found.add(".".join(parts[:at]))
        index.append(int(parts[at]))
    if len(found) != 1:
        return None
    blocks = modules[found.pop()]
    assert isinstance(blocks, nn.ModuleList)
    return blocks, index


class Resume:
    """Forward passes of `run` (a batch -> the model's outputs) over fixed `batches` that start at a block of
    `blocks`: `start(j, state)` keeps what enters block j, `state` holding a hashable key of each earlier
    block's state (the model must be in it), running only the blocks not passed since an earlier `start`
    whose blocks were in the same state; then `replaying()` runs the model with the blocks before j returning
    what was kept. With `hold` (a context keeping some blocks' weights on the device: `onload.held`), blocks
    run layer-major: every batch through one block before the next, each block's weights moved once
    (`resumed`). `ran` counts, per block, the passes that ran it to keep outputs."""

    def __init__(
        self,
        blocks: nn.ModuleList,
        batches: list[dict],
        run: Callable[[dict], Any],
        hold: Callable[[list[nn.Module]], AbstractContextManager] | None = None,
    ) -> None:
        self.blocks, self.batches, self.run, self.hold = blocks, batches, run, hold
        self.state: tuple = ()  # the state of the blocks before the kept outputs' block, len(state) of them
        self.kept: list[Any] = []  # per batch, what block len(state) - 1 returned
        self.ran = [0] * len(blocks)  # per block, the passes over the batches that ran it to keep outputs

    def start(self, j: int, state: tuple[Hashable, ...]) -> None:
        """Keep what enters block j with the blocks before it in `state` (j keys), going on from the outputs
        already kept where their blocks are in the same state; with `hold`, one block at a time."""
        assert len(state) == j
        if state[: len(self.state)] != self.state:  # an earlier block changed, or j lies before the kept
            self.state, self.kept = (), []
        if j == len(self.state):
            return
        for k in range(len(self.state) + 1, j + 1) if self.hold else (j,):
            self._keep(k, tuple(state[:k]))

    def _keep(self, j: int, state: tuple[Hashable, ...]) -> None:
        """Run the batches from the kept outputs to block j (exclusive) and keep what it is given."""
        at, kept = len(self.state), []

        def keep(module: nn.Module, args: tuple, output: Any) -> None:
            kept.append(output)
            raise _Stop

        held = self.hold(list(self.blocks)[at:j]) if self.hold else nullcontext()
        with hooks([(self.blocks[j - 1], "forward", keep)]), self.replaying(), held:
            for batch in self.batches:
                with suppress(_Stop):
                    self.run(batch)
        for i in range(at, j):
            self.ran[i] += 1
        self.state, self.kept = state, kept

    @contextmanager
    def resumed(self) -> Iterator[None]:
        """The context a pass over the batches starts at the kept outputs in: `replaying` them and, with
        `hold`, every later block first run over all the batches in turn (layer-major), so the pass runs only
        what follows the chain. Nothing is kept after."""
        if not self.hold:
            with self.replaying():
                yield
            return
        tail = Resume(self.blocks, self.batches, self.run, self.hold)
        tail.state, tail.kept = self.state, self.kept
        later = len(self.blocks) - len(self.state)
        tail.start(len(self.blocks), self.state + (None,) * later)
        with tail.replaying():
            yield

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """The blocks before the kept outputs' block return them (batch by batch, in the order of `batches`)
        instead of running; a caller's forward replacement (accelerate's device hooks) comes back after."""
        if not self.state:
            yield
            return
        outputs = iter(self.kept)
        current: list[Any] = []

        def first(*args: Any, **kwargs: Any) -> Any:
            current[:] = [next(outputs)]
            return current[0]

        def later(*args: Any, **kwargs: Any) -> Any:
            return current[0]

        skipped = list(self.blocks)[: len(self.state)]
        saved = [block.__dict__.get("forward") for block in skipped]
        try:
            for i, block in enumerate(skipped):
                block.forward = first if i == 0 else later
            yield
        finally:
            for block, forward in zip(skipped, saved):
                if forward is None:
                    del block.forward
                else:
                    block.forward = forward

    @torch.no_grad()
    def proven(self, whole: Callable[[], torch.Tensor], resumed: Callable[[], torch.Tensor]) -> bool:
        """Whether `resumed()` (values of the model measured through `start` and `replaying`) equals
        `whole()` (the same over the whole model) bit for bit, twice: a block that changed what it was given
        would differ the second time. What was kept is dropped after."""
        expected = whole()
        proven = torch.equal(resumed(), expected) and torch.equal(resumed(), expected)
        self.state, self.kept = (), []
        return proven
