"""The C allocator's freed memory on the CPU: handed back to the system between batches, and (for a process
that opts in, as the `prune-heads` command does) blocks of an activation's size mapped on their own, so what
a step frees leaves resident memory. Figures: benchmarks/README.md, "Decoder LLMs: work and memory"."""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch import for the allocator helpers
    from torch import nn

HEAP_BLOCK_LIMIT = 256 * 1024  # bytes: blocks this size and larger are mapped on their own where asked
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


@functools.cache
def _glibc(name: str):
    """glibc's function `name`, looked up on first use; None elsewhere (macOS, Windows, musl)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError, TypeError):
        return None


def release_freed_memory() -> None:
    """Return the free memory glibc's malloc holds to the system (`malloc_trim`; elsewhere nothing). Called
    between batches: glibc's adaptive threshold otherwise keeps each freed batch's logits on a heap that the
    small results kept per batch pin, so a pass's resident memory would grow by about a batch's logits per
    batch. It changes no setting of the allocator."""
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


def map_large_blocks(threshold: int = HEAP_BLOCK_LIMIT) -> bool:
    """Have glibc's malloc map every block of `threshold` bytes or more on its own (`mallopt(M_MMAP_THRESHOLD)`)
    so that freeing it returns it to the system at once, instead of glibc raising that threshold to the
    largest block freed so far and keeping a step's freed activations resident until the step ends.
    Process-wide and for good (glibc's adaptive threshold is off after it), so the `prune-heads` command sets
    it for its own process once a command runs, and the library only when a caller asks
    (`ph.map_large_blocks()`, once at a pipeline's start). Returns whether it was set (False off glibc)."""
    mallopt = _glibc("mallopt")
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, threshold))


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
