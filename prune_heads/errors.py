"""The errors that ask the user to fix their input. Every one is a `PruneHeadsError`: its message's first line
names what is wrong and the fix, and the `prune-heads` command prints that line and exits 2. Any other
exception is a bug, shown with its traceback."""

from __future__ import annotations


class PruneHeadsError(Exception):
    """Input that cannot be used (a model, data, budget, plan, recipe, configuration or output); the message
    names the fix."""


class ConfigError(PruneHeadsError, ValueError):
    """A configuration (or recipe) that cannot be used; the message names the key and what would be valid."""
