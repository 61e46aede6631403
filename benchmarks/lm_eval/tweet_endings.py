"""The documents of the tweet_endings lm-eval task: sentence_endings built from the tweet-snippets fixture's test
split (../shared/fixtures), a domain the benchmarks never calibrate on."""

import json
from pathlib import Path

import datasets

from prune_heads.data.lm_eval.endings import endings

TWEETS = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "tweet-snippets" / "test.jsonl"


def documents(**kwargs) -> dict[str, datasets.Dataset]:
    """Every tweet of the test split long enough, as `endings` makes them."""
    return endings([json.loads(line)["sentence"] for line in TWEETS.read_text().splitlines()])
