import math

import pytest
import tiny_models as tm
import torch

import prune_heads as ph
from prune_heads.config import GENERAL_MODES
from prune_heads.recovery.general import GIVEN, SEED, SHARE, WRITTEN, general_text
from prune_heads.recovery.generated import written_batches
from prune_heads.recovery.holdout import balanced, set_weights
from prune_heads.recovery.search import first_examples
from prune_heads.runtime.ledger import Stage
from prune_heads.task_data import DataError


def _lm_batches(n: int, batch: int = 4) -> list[dict]:
    return [dict(b, labels=b["input_ids"]) for b in tm.batches("llama", n=n, batch=batch)]


def test_each_set_counts_the_same_whatever_its_size():
    values = torch.tensor([1.0, 1.0, 1.0, 4.0], dtype=torch.float64)  # three of the calibration's, one other
    weighted = balanced(values, 3)
    assert float(weighted.mean()) == pytest.approx((1.0 + 4.0) / 2)
    assert set_weights(3, 1) == (4 / 6, 4 / 2)
    assert torch.equal(balanced(values, 4), values)


def test_a_language_model_is_judged_on_text_it_writes_beside_the_search_and_the_held_out_batches():
    model, calib, heldout = tm.build("llama"), _lm_batches(5), _lm_batches(2)
    general, note = general_text(model, calib, heldout, None, search_examples=8, seed=3)
    assert note is None and general.source == WRITTEN
    width = calib[0]["input_ids"].shape[1]
    rows = math.ceil(SHARE * 4)
    assert len(general.search) == len(first_examples(calib, 8)) == 2  # one beside each searched batch
    assert all(b["input_ids"].shape == (rows, width) for b in general.search)
    assert sum(b["input_ids"].shape[0] for b in general.heldout) == math.ceil(SHARE * 8)
    assert all(torch.equal(b["labels"], b["input_ids"]) for b in general.heldout)
    assert general.written == general.search + general.heldout
    again, _ = general_text(model, calib, heldout, None, search_examples=8, seed=3)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(general.heldout, again.heldout))
    own = written_batches(model, rows * 2, rows, width, 3, progress=False)  # a run without data calibrates on
    assert not torch.equal(own[0]["input_ids"], general.search[0]["input_ids"])
    assert torch.equal(
        written_batches(model, rows * 2, rows, width, 3 + SEED, False)[0]["input_ids"], general.search[0]["input_ids"]
    )


def test_eval_data_takes_the_written_texts_place_and_needs_labels():
    model, calib, heldout = tm.build("llama"), _lm_batches(5), _lm_batches(2)
    given = _lm_batches(6)
    general, _ = general_text(model, calib, heldout, given, search_examples=8, seed=0)
    assert general.source == GIVEN and general.search == given[:2] and general.heldout == given[2:]
    assert general.written == []
    with pytest.raises(DataError, match="no labels"):
        general_text(model, calib, heldout, tm.batches("llama", n=2), search_examples=8, seed=0)


def test_an_encoder_has_no_guard_unless_given_labelled_text():
    model, calib = tm.build("bert"), tm.batches("bert", n=4)
    general, note = general_text(model, calib, calib[:1], None, search_examples=8, seed=0)
    assert general is None and note.startswith("general-ability guard off: this model writes no text")
    general, note = general_text(model, calib, calib[:1], tm.batches("bert", n=3), search_examples=8, seed=0)
    assert note is None and len(general.search) == 1 and len(general.heldout) == 2
    with pytest.raises(DataError, match="no labels"):
        general_text(model, calib, calib[:1], tm.batches("bert", n=3, labels=False), search_examples=8, seed=0)


@pytest.fixture(scope="module")
def guarded():
    """A tiny Llama pruned the default way with the guard's text reported, weighed and left out, on the same
    batches."""
    found = {}
    for mode in GENERAL_MODES:
        model = tm.build("llama")
        config = ph.PruneConfig(
            selection=ph.SelectionConfig(num_heads=4), recovery=ph.RecoveryConfig(general=mode, epochs=1)
        )
        found[mode] = ph.prune_model(model, _lm_batches(10), config, progress=False)
    return found


def _decisions(result: ph.PruneResult) -> list[dict]:
    """Each step of the flow as decided, its seconds left out."""
    return [{k: v for k, v in step.items() if k != "seconds"} for step in result.recovery if step["step"] != "notes"]


def test_the_default_reports_the_change_on_the_models_own_text_and_decides_as_the_calibration_alone(guarded):
    report, off = guarded["report"], guarded["off"]
    assert ph.RecoveryConfig().general == "report"
    assert report.heldout["general"] == {"source": WRITTEN, "examples": 4}  # half of the 8 held out
    assert math.isfinite(report.heldout["general_perplexity_change"])
    assert "general" not in off.heldout and "general_perplexity_change" not in off.heldout
    assert report.plan == off.plan and _decisions(report) == _decisions(off)
    assert report.heldout["perplexity_change"] == off.heldout["perplexity_change"]
    assert Stage.GENERATION in report.work and Stage.GENERATION not in off.work
    assert report.work[Stage.SEARCH] == off.work[Stage.SEARCH]  # nothing written beside the search


def test_weighed_every_measurement_sees_both_sets(guarded):
    weigh, off = guarded["weigh"], guarded["off"]
    assert weigh.heldout["general"] == {"source": WRITTEN, "examples": 4, "weighed": True}
    assert weigh.work.heldout_pass == pytest.approx(1.5 * off.work.heldout_pass)
    assert weigh.work[Stage.SEARCH] > off.work[Stage.SEARCH]


def test_the_guard_is_deterministic(guarded):
    model = tm.build("llama")
    recovery = ph.RecoveryConfig(general="weigh", epochs=1)
    config = ph.PruneConfig(selection=ph.SelectionConfig(num_heads=4), recovery=recovery)
    again = ph.prune_model(model, _lm_batches(10), config, progress=False)
    assert again.plan == guarded["weigh"].plan and again.heldout == guarded["weigh"].heldout


def test_an_unknown_mode_is_refused():
    with pytest.raises(ph.ConfigError, match="recovery.general is 'always'; give one of report, weigh, off"):
        ph.RecoveryConfig(general="always")


def test_an_encoder_prunes_with_the_guard_off_and_says_so():
    model = tm.build("bert")
    config = ph.PruneConfig(selection=ph.SelectionConfig(num_heads=4), recovery=ph.RecoveryConfig(epochs=1))
    result = ph.prune_model(model, tm.batches("bert", n=6), config, progress=False)
    notes = next(e["notes"] for e in result.recovery if e["step"] == "notes")
    assert any(n.startswith("general-ability guard off") for n in notes) and "general" not in result.heldout
