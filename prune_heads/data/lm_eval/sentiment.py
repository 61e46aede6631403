"""The documents of the review_sentiment lm-eval task: the movie-review sentences prune-heads ships, each with
its sentiment label (0 negative, 1 positive)."""

import json
from pathlib import Path

import datasets

SENTENCES = Path(__file__).resolve().parent.parent / "demo_sentences.jsonl"


def documents(**kwargs) -> dict[str, datasets.Dataset]:
    """Every shipped sentence with its label, in file order."""
    rows = [json.loads(line) for line in SENTENCES.read_text().splitlines()]
    return {"test": datasets.Dataset.from_list([{"text": r["text"], "label": int(r["label"])} for r in rows])}
