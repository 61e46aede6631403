"""`prune_model`'s reports and weights, saved: a change to how the flow is written must not change what it
does (plans, decisions, held-out values, counted work, pruned weights). After a change that is meant to change
them, write them again with PRUNE_HEADS_WRITE_REPORTS=1 and say why in the commit."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import tiny_models as tm
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import prune_heads as ph

SAVED = Path(__file__).parent / "reports"
WRITE = os.environ.get("PRUNE_HEADS_WRITE_REPORTS") == "1"


def check(name: str, result: ph.PruneResult, model) -> None:
    found = json.loads(json.dumps(tm.snapshot(result, model)))
    path = SAVED / f"{name}.json"
    if WRITE:
        path.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    tm.assert_close(found, json.loads(path.read_text()))


CASES = {  # name: (family, labelled (a classifier, made sensitive), heads to remove, recovery settings)
    "tiny-llama": ("llama", False, 4, {}),
    "tiny-bert": ("bert", True, 4, {}),
    "tiny-gpt2": ("gpt2", False, 5, {}),
    "tiny-llama-budget": ("llama", False, 4, {"tuning_budget": 2.0}),  # the search refused, tuning kept
    "tiny-llama-bias": ("llama", False, 4, {"reconstruction": False}),  # bias compensation, tuning kept
    "tiny-bert-bias": ("bert", True, 6, {"reconstruction": False}),
}


@pytest.mark.parametrize("name", CASES)
def test_the_flow_on_tiny_models_is_unchanged(name):
    family, labels, heads, recovery = CASES[name]
    model = tm.sensitive(tm.build(family)) if labels else tm.build(family)
    config = ph.PruneConfig(
        selection=ph.SelectionConfig(num_heads=heads), recovery=dataclasses.replace(ph.RecoveryConfig(), **recovery)
    )
    result = ph.prune_model(model, tm.batches(family, n=12, labels=labels, batch=6), config, progress=False)
    check(name, result, model)


@pytest.mark.slow
def test_the_default_flow_on_the_fixture_is_unchanged(fixture_model_path, fixture_data_path):
    tokenizer = AutoTokenizer.from_pretrained(fixture_model_path)
    model = AutoModelForSequenceClassification.from_pretrained(fixture_model_path).eval()
    data = ph.load_task_data(str(fixture_data_path), tokenizer, split="validation[:120]", batch_size=24, max_length=48)
    result = ph.prune_model(model, data, ph.PruneConfig(), progress=False)
    check("fixture-movie", result, model)
