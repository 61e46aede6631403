"""The documents of the sentence_endings lm-eval task, built from the sentences prune-heads ships."""

import json
import math
import random
from pathlib import Path

import datasets

SENTENCES = Path(__file__).resolve().parent.parent / "demo_sentences.jsonl"
CHOICES, CONTEXT, SHORTEST = 4, 0.6, 8  # endings to choose from; share of words given; words a sentence needs


def documents(**kwargs) -> dict[str, datasets.Dataset]:
    """The task's documents from the sentences prune-heads ships (`endings`)."""
    return endings([json.loads(line)["text"] for line in SENTENCES.read_text().splitlines()])


def endings(texts: list[str]) -> dict[str, datasets.Dataset]:
    """Every text of at least SHORTEST words: its first CONTEXT of words, its true ending and three others'
    endings in a seeded order (`label`: where the true one is)."""
    split = [
        (words[: math.ceil(CONTEXT * len(words))], words[math.ceil(CONTEXT * len(words)) :])
        for words in (text.split() for text in texts)
        if len(words) >= SHORTEST
    ]
    endings = [" ".join(end) for _, end in split]
    rng = random.Random(0)
    docs = []
    for i, (context, _) in enumerate(split):
        others = rng.sample([j for j in range(len(split)) if j != i], CHOICES - 1)
        choices = [endings[j] for j in [i, *others]]
        rng.shuffle(choices)
        docs.append({"context": " ".join(context), "choices": choices, "label": choices.index(endings[i])})
    return {"test": datasets.Dataset.from_list(docs)}
