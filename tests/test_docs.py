"""The front page and docs/: size, links, the generated CLI reference, and every command and snippet they show."""

import ast
import re
import shlex
import sys
from pathlib import Path

import click
import pytest

from prune_heads.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
FENCE = re.compile(r"```(\w+)\n(.*?)```", re.S)


def blocks(language: str) -> list[tuple[Path, str]]:
    return [(page, body) for page in PAGES for lang, body in FENCE.findall(page.read_text()) if lang == language]


def test_the_front_page_is_short_and_reaches_every_docs_page():
    assert len((ROOT / "README.md").read_bytes()) <= 12 * 1024
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        for target in LINK.findall(page.read_text()):
            if target.startswith("http"):
                continue
            path = (page.parent / target).resolve()
            assert path.exists(), f"{page.name} links to {target}, which does not exist"
            if path.suffix == ".md" and path not in seen:
                seen.add(path)
                todo.append(path)
    assert {p.resolve() for p in PAGES} - {(ROOT / "README.md").resolve()} <= seen


def test_the_cli_reference_is_generated_from_the_commands():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import make_cli_reference
    finally:
        sys.path.remove(str(ROOT / "docs"))
    assert (ROOT / "docs" / "cli-reference.md").read_text() == make_cli_reference.reference(), (
        "docs/cli-reference.md is stale: run .venv/bin/python docs/make_cli_reference.py"
    )


def commands() -> list[tuple[str, list[str]]]:
    """Every `prune-heads ...` line of the bash blocks, split as the shell would (comments dropped)."""
    found = []
    for page, body in blocks("bash"):
        for line in body.splitlines():
            words = shlex.split(line, comments=True)
            if "&&" in words:  # `bash .ci/setup && .venv/bin/prune-heads demo`: the part after the last &&
                words = words[len(words) - words[::-1].index("&&") :]
            if words and Path(words[0]).name == "prune-heads":
                found.append((f"{page.name}: {line.strip()}", words[1:]))
    return found


def test_the_documents_show_every_command():
    shown = {words[1] if words[0] in ("-q", "--quiet") else words[0] for _, words in commands()}
    assert shown == set(main.commands), f"commands no page shows: {sorted(set(main.commands) - shown)}"


@pytest.mark.parametrize("shown, words", commands(), ids=[c[0][:90] for c in commands()])
def test_every_command_shown_parses(shown, words, tmp_path, monkeypatch):
    """Options, choices, ranges and arity are checked by click; only paths that do not exist here may fail."""
    monkeypatch.chdir(tmp_path)
    context = click.Context(main, info_name="prune-heads")
    while words and words[0] in ("-q", "--quiet"):  # the group's only option
        words = words[1:]
    name, *args = words
    command = main.get_command(context, name)
    assert command is not None, f"{shown}: no command {name}"
    try:
        command.make_context(name, args, parent=context)
    except click.BadParameter as error:
        assert "does not exist" in str(error), f"{shown}: {error}"


def test_every_python_snippet_is_valid_python():
    snippets = blocks("python")
    assert len(snippets) >= 8
    for page, body in snippets:
        try:
            ast.parse(body)
        except SyntaxError as error:
            raise AssertionError(f"{page.name}: {error}\n{body}") from None


def test_the_short_commands_run(tmp_path):
    from click.testing import CliRunner

    runner = CliRunner()
    listed = runner.invoke(main, ["recipes"])
    assert listed.exit_code == 0 and "demo-minilm-embeddings" in listed.output
    shown = runner.invoke(main, ["recipes", "fixture-minilm-sentiment"])
    assert shown.exit_code == 0 and "selection" in shown.output


def test_every_install_line_works_as_written_from_a_clone():
    """`pip install` lines install this clone (`.` or `".[extra]"` with extras pyproject.toml defines) or
    packages pinned by name; prune-heads itself is not published, so its name never appears as a package."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    extras = set(re.findall(r"^(\w+) = \[", pyproject.split("[project.optional-dependencies]")[1], re.M))
    lines = [(page.name, line) for page in PAGES for line in re.findall(r"pip install[^`\n]*", page.read_text())]
    assert lines
    for page, line in lines:
        targets = [w for w in shlex.split(line)[2:] if not w.startswith("-")]
        for target in targets:
            assert not target.startswith("prune-heads"), f"{page}: {line} names an unpublished package"
            if target.startswith("."):
                asked = set(re.findall(r"\w+", target.split("[", 1)[1])) if "[" in target else set()
                assert asked <= extras, f"{page}: {line} asks for extras pyproject.toml lacks: {asked - extras}"


FIGURE = re.compile(r"(?<![\w.])[+-]?(\d+\.\d+)(%|x)?(?!\w|\.\d)")  # 0.851, +1.4%, 1.36x (the sign aside)


def quoted_figures() -> list[tuple[str, str]]:
    """The measured figures the front page's results, docs/benchmarks.md and the docs' tables quote."""
    readme = (ROOT / "README.md").read_text()
    results = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    pages = [("README.md", results), ("docs/benchmarks.md", (ROOT / "docs" / "benchmarks.md").read_text())]
    for page in sorted((ROOT / "docs").glob("*.md")):  # tables of figures; fenced blocks are examples of output
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        rows = "\n".join(l for l in prose.splitlines() if l.startswith("|") and "---" not in l)
        pages.append((f"docs/{page.name}", rows))
    return [(name, "".join(m)) for name, text in pages for m in FIGURE.findall(text)]


def test_every_figure_the_docs_quote_is_in_the_benchmark_tables():
    """benchmarks/README.md is the one source of the figures: a figure quoted elsewhere that it does not hold
    is stale (or was never measured)."""
    held = {"".join(m) for m in FIGURE.findall((ROOT / "benchmarks" / "README.md").read_text())}
    missing = sorted({f"{page}: {figure}" for page, figure in quoted_figures() if figure not in held})
    assert len(quoted_figures()) > 50 and not missing, missing


def test_the_benchmark_tables_are_short_and_user_docs_name_no_issues():
    tables = ROOT / "benchmarks" / "README.md"
    assert len(tables.read_bytes()) <= 30 * 1024  # the current tables; history goes to research-log.md
    for page in [ROOT / "README.md", tables, *sorted((ROOT / "docs").glob("*.md"))]:
        assert not re.search(r"\bissues? \d", page.read_text()), f"{page.name} refers to an issue number"


def sentences(page: Path) -> list[str]:
    """The prose sentences of a page: code, tables and headings left out, inline code and links one word each."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    lines = [l for l in text.splitlines() if not l.lstrip().startswith(("|", "#"))]
    prose = re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", "X", "\n".join(lines)))
    items = re.split(r"\n\s*\n|\n\s*(?:[-*]|\d+\.) ", prose)  # paragraphs and list items end sentences too
    found = [s for item in items for s in re.split(r"(?<=[.!?])\s+(?=[A-Z(\[*X])", " ".join(item.split()))]
    return [s for s in found if s.strip()]


USER_PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "cli-reference.md")]


def test_the_user_pages_are_short_and_their_sentences_too():
    """A user reads a page in minutes: at most 8 KB each (the generated CLI reference aside), at most ten
    sentences over 40 words across them and none over 60."""
    sizes = {p.name: len(p.read_bytes()) for p in USER_PAGES}
    assert all(size <= 8 * 1024 for size in sizes.values()), {n: s for n, s in sizes.items() if s > 8 * 1024}
    long = [(p.name, s) for p in USER_PAGES for s in sentences(p) if len(s.split()) > 40]
    assert len(long) <= 10 and all(len(s.split()) <= 60 for _, s in long), long
