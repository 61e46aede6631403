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


def _labelled(batches: list[dict]) -> list[dict]:
    """A decoder's batches with their own next tokens as labels (padding left out), so perplexity is measured."""
    return [dict(b, labels=b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)) for b in batches]


SELECTIONS = {  # name: (the tiny decoder, selection, recovery settings): the budgets and steps changed most
    "tiny-llama-kv-cache": (tm.build, {"kv_cache": "8KiB@64"}, {}),
    "tiny-llama-max-loss": (tm.build, {"max_loss": 50.0}, {"kv_sharing": False}),
    "tiny-llama-depths": (tm.build, {"num_heads": 4, "depths": "1/6,1/2"}, {}),
    "tiny-planted-llama-shared": (lambda name: tm.planted_llama(), {"kv_cache": "6KiB@64"}, {}),
    "tiny-planted-llama-max-loss-shared": (lambda name: tm.planted_llama(), {"max_loss": 0.1}, {}),
    "tiny-llama-healed": (tm.build, {"num_heads": 4}, {"heal": 400}),
}


@pytest.mark.parametrize("name", SELECTIONS)
def test_the_budgets_sharing_and_healing_on_a_tiny_decoder_are_unchanged(name):
    build, selection, recovery = SELECTIONS[name]
    model = build("llama")
    config = ph.PruneConfig(selection=ph.SelectionConfig(**selection), recovery=ph.RecoveryConfig(**recovery))
    result = ph.prune_model(model, _labelled(tm.batches("llama", n=12, batch=6)), config, progress=False)
    check(name, result, model)


@pytest.mark.slow
def test_the_default_flow_on_the_fixture_is_unchanged(fixture_model_path, fixture_data_path):
    tokenizer = AutoTokenizer.from_pretrained(fixture_model_path)
    model = AutoModelForSequenceClassification.from_pretrained(fixture_model_path).eval()
    data = ph.load_task_data(str(fixture_data_path), tokenizer, split="validation[:120]", batch_size=24, max_length=48)
    result = ph.prune_model(model, data, ph.PruneConfig(), progress=False)
    check("fixture-movie", result, model)
