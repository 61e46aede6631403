"""Progress bars on stderr: ours only on a terminal and without --quiet, other libraries' likewise."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterable, Iterator

from tqdm import std as tqdm_std
from tqdm.auto import tqdm


def bars_wanted() -> bool:
    """Whether progress bars may show: TQDM_DISABLE is not set (`--quiet` sets it) and stderr is a terminal."""
    return os.environ.get("TQDM_DISABLE", "").lower() in ("", "0", "false") and sys.stderr.isatty()


def progress_bar(iterable: Iterable | None, desc: str, total: int | None = None, enabled: bool = True):
    """A tqdm bar on stderr, shown only when `enabled` and `bars_wanted()` (without `iterable`, one to update)."""
    return tqdm(iterable, desc=desc, total=total, leave=False, disable=not (enabled and bars_wanted()))


@contextlib.contextmanager
def library_bars() -> Iterator[None]:
    """Other libraries' tqdm bars (transformers' weight loading and GGUF dequantization, datasets' split
    generation, lm-eval's requests) off inside, unless `bars_wanted()`. tqdm reads TQDM_DISABLE only when it
    is imported, so for the duration its constructor is made to disable every bar. Also a decorator."""
    if bars_wanted():
        yield
        return
    original = tqdm_std.tqdm.__init__

    @functools.wraps(original)
    def disabled(self, *args, **kwargs):
        original(self, *args, **{**kwargs, "disable": True})

    tqdm_std.tqdm.__init__ = disabled
    try:
        yield
    finally:
        tqdm_std.tqdm.__init__ = original
