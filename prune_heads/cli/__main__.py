"""`python -m prune_heads.cli`: the `prune-heads` command."""

from . import entry

entry()
