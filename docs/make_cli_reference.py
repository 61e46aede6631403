"""Writes docs/cli-reference.md from the click commands themselves, so the reference cannot drift from the code
(tests/test_docs.py fails when the file differs from what this prints).

Run: .venv/bin/python docs/make_cli_reference.py
"""

from __future__ import annotations

from pathlib import Path

import click

from prune_heads.cli import main

PAGE = Path(__file__).resolve().parent / "cli-reference.md"
WIDTH = 110  # the group's own max_content_width


def help_text(command: click.Command, name: str, parent: click.Context | None = None) -> str:
    """The command's --help output at a fixed width (the terminal's does not matter)."""
    return click.Context(command, info_name=name, parent=parent, terminal_width=WIDTH).get_help()


def reference() -> str:
    """The whole page: the group's help, then every command's, in alphabetical order."""
    root = click.Context(main, info_name="prune-heads", terminal_width=WIDTH, **main.context_settings)
    parts = [
        "# CLI reference\n",
        "Generated from the click commands by `docs/make_cli_reference.py`; do not edit by hand. The overview",
        "with examples is [command-line.md](command-line.md).\n",
        "## prune-heads\n",
        "```text",
        root.get_help(),
        "```\n",
    ]
    for name in sorted(main.commands):
        parts += [f"## prune-heads {name}\n", "```text", help_text(main.commands[name], name, root), "```\n"]
    return "\n".join(parts)


if __name__ == "__main__":
    PAGE.write_text(reference())
    print(f"wrote {PAGE}")
