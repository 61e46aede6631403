"""Publishing a pruned model: a model card that says what was removed and what it cost, in one Hub commit."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi
from torch import nn

from ..evaluation.report import Report
from ..model.surgery import RECORD_KEY
from .persistence import HUB_ID, write_model


def _record(config: dict) -> dict:
    return (config.get(RECORD_KEY) or config.get("pruned_from") or {}).get("layers", {})


def _how_to_load(config: dict) -> str:
    auto = sorted(config.get("auto_map", {}))
    if auto:
        return (
            f"```python\nfrom transformers import {auto[0]}\nmodel = {auto[0]}.from_pretrained(REPO, "
            f"trust_remote_code=True)  # the modeling file re-applies the head removal\n```"
        )
    if RECORD_KEY not in config:
        return "A stock config: `AutoModel*.from_pretrained(REPO)` and other runtimes load it as it is."
    return "```python\nimport prune_heads as ph  # pip install prune-heads\nmodel = ph.load_pruned(REPO)\n```"


def model_card(folder: str | os.PathLike, base_model: str | None = None) -> str:
    """The README.md for a pruned checkpoint folder: base model, method, the before/after table (from the
    folder's report.json when `prune-heads run` wrote one), the heads kept per layer, and how to load it."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    report = Report.load(folder / "report.json") if (folder / "report.json").exists() else None
    meta = report.meta if report is not None else {}
    base = base_model or meta.get("model") or config.get("_name_or_path") or "unknown"
    layers = _record(config)
    removed = sum(len(entry["removed"]) for entry in layers.values())
    total = sum(entry["num_heads"] for entry in layers.values())
    on_hub = HUB_ID.match(base) is not None and not Path(base).exists()
    front = ["---", "library_name: transformers", "tags: [prune-heads, pruned, attention-head-pruning]"]
    front += [f"base_model: {base}"] if on_hub else []
    lines = front + ["---", "", f"# {base}, {removed} of {total} attention heads removed", ""]
    lines += [
        f"Attention heads physically removed from "
        f"{f'[{base}](https://huggingface.co/{base})' if on_hub else base} with prune-heads "
        f"(`pip install prune-heads`): smaller weights, fewer FLOPs, no retraining."
    ]
    if meta:
        recovery = ", ".join(meta.get("recovery") or {}) or "none"
        lines += [
            "",
            f"Method: {meta.get('method')} scores ({meta.get('steps', 1)} step(s), "
            f"{meta.get('score_examples', 0)} examples), recovery: {recovery}.",
        ]
    lines += ["", "## How to load", "", _how_to_load(config)]
    if report is not None:
        table = report.markdown().splitlines()
        start, end = table.index("| | before | after | change |"), table.index("| layer | heads kept |")
        examples = report.before.get("metrics", {}).get("examples")
        lines += ["", "## Before and after", ""]
        lines += [f"Measured on {examples} evaluation examples.", ""] if examples else []
        lines += "\n".join(table[start:end]).strip().splitlines()
    lines += ["", "## Heads kept", "", "| layer | heads kept | removed (original indices) |", "|---|---|---|"]
    for name, entry in layers.items():
        kept = entry["num_heads"] - len(entry["removed"])
        lines.append(f"| {name} | {kept} / {entry['num_heads']} | {entry['removed'] or '-'} |")
    if (folder / "heads_per_layer.png").exists():
        lines += ["", "![heads kept per layer](heads_per_layer.png)"]
    return "\n".join(lines) + "\n"


def push_pruned(
    model: nn.Module | str | os.PathLike,
    repo_id: str,
    tokenizer: Any = None,
    report: Report | None = None,
    base_model: str | None = None,
    standalone: bool = False,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "Upload pruned model (prune-heads)",
    api: HfApi | None = None,
) -> Any:
    """Push a pruned model (a module, or a folder that `save_pruned` / `prune-heads run` wrote) to the Hub
    repo `repo_id` in one commit, with a model card (`model_card`) as README.md. A module is written the way
    `save_pruned` writes it (`standalone` as there), with `report` if given. Creates the repo if needed and
    returns the commit info. `api` is a `huggingface_hub.HfApi` (made from `token` when not given). Its
    keywords are `huggingface_hub`'s own upload options beside `save_pruned`'s, one for one.
    """
    api = api or HfApi(token=token)
    with tempfile.TemporaryDirectory() as tmp:
        if isinstance(model, nn.Module):
            folder = Path(tmp)
            write_model(model, folder, tokenizer, standalone)
            if report is not None:
                report.write(folder)
        else:
            folder = Path(model)
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "README.md")
        operations = [
            CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=str(p)) for p in files
        ]
        operations.append(CommitOperationAdd("README.md", model_card(folder, base_model).encode()))
        api.create_repo(repo_id, private=private, exist_ok=True)
        return api.create_commit(repo_id=repo_id, operations=operations, commit_message=commit_message)
