"""One way to attach module hooks for the length of a block."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from torch import nn

Hook = tuple[nn.Module, str, Callable]  # (module, "forward_pre" | "forward", function)


@contextmanager
def hooks(registrations: Iterable[Hook], with_kwargs: bool = False, prepend: bool = False) -> Iterator[None]:
    """Register each (module, kind, function) hook, and remove them all on exit (also on an error).
    `prepend` runs them before the hooks already there."""
    handles = []
    try:
        for module, kind, function in registrations:
            register = getattr(module, f"register_{kind}_hook")
            options = {"with_kwargs": True} if with_kwargs else {}
            handles.append(register(function, prepend=prepend, **options))
        yield
    finally:
        for handle in handles:
            handle.remove()
