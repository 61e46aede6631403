"""The C allocator's freed memory on the CPU: handed back to the system between batches, and (for the CLI's
own process) blocks of an activation's size mapped on their own, so what a step frees leaves resident memory."""

from __future__ import annotations

import ctypes

HEAP_BLOCK_LIMIT = 256 * 1024  # bytes: the CLI maps blocks this size and larger on their own (measured below)
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


def _glibc(name: str):
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, Windows, musl): nothing to do
        return None


_TRIM = _glibc("malloc_trim")
_MALLOPT = _glibc("mallopt")


def release_freed_memory() -> None:
    """Return the free memory glibc's malloc holds to the system (`malloc_trim`; elsewhere nothing). Once a
    tensor of a batch's logits size has been freed, glibc's adaptive mmap threshold puts later ones of that
    size on its heap, and the small results kept per batch pin the heap: a pass over N batches on the CPU then
    grows the resident memory by about one batch's logits per batch although nothing holds them (SmolLM2-135M
    at 1 x 128 tokens: 4.3 GB over 166 batches). Called between batches, it keeps the pass at one batch's peak."""
    if _TRIM is not None:
        _TRIM(0)


def map_large_blocks(threshold: int = HEAP_BLOCK_LIMIT) -> bool:
    """Have glibc's malloc map every block of `threshold` bytes or more on its own (`mallopt(M_MMAP_THRESHOLD)`)
    so that freeing it returns it to the system at once. By default glibc raises that threshold to the size of
    the largest mapped block freed so far (up to 32 MiB), after which a forward and backward pass's activations
    live on the heap and the ones it frees stay resident until the step ends: on the 135M Llama shape at 256
    tokens the scoring pass peaked about 90 MiB and the default path about 120 MiB lower with 256 KiB (benchmarks),
    the default path +8.4-9.4% of the weights above the scoring pass against +12-15% without. Process-wide and for
    good (it turns glibc's adaptive threshold off), so the `prune-heads` command sets it for its own process and
    the library leaves a caller's process as it is. Returns whether it was set (False off glibc)."""
    return _MALLOPT is not None and bool(_MALLOPT(_M_MMAP_THRESHOLD, threshold))
