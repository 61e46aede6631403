import dataclasses

import pytest
import tiny_models as tm
import torch

import prune_heads as ph
from prune_heads.config import SHARE, ConfigError
from prune_heads.recovery.generated import draw, nucleus, sample, with_generated, writes_text, written_batches
from prune_heads.runtime.ledger import Stage
from prune_heads.task_data import without_labels


def test_only_a_decoder_only_language_model_writes_its_own_text():
    assert writes_text(tm.build("llama")) and writes_text(tm.build("gpt2"))
    assert not writes_text(tm.build("bert")) and not writes_text(tm.build("t5"))


def test_a_batch_of_sampled_text_follows_each_calibration_batch():
    model = tm.build("llama")
    given = [dict(b, labels=b["input_ids"]) for b in tm.batches("llama", n=3, batch=8)]
    given[1]["attention_mask"][:, :2] = 0  # left padding: a row starts at its first attended token
    out, generated = with_generated(model, given, SHARE, seed=0)
    assert [b is g for b, g in zip(out[::2], given)] == [True] * 3 and out[1::2] == generated
    for batch, extra in zip(given, generated):
        assert extra["input_ids"].shape == (3, batch["input_ids"].shape[1])  # round(0.375 * 8) as wide
        assert torch.equal(extra["labels"], extra["input_ids"]) and bool(extra["attention_mask"].all())
    starts = torch.stack([row[m.bool()][0] for row, m in zip(given[1]["input_ids"], given[1]["attention_mask"])])
    assert torch.equal(generated[1]["input_ids"][:, 0], starts[:3])
    assert "labels" not in with_generated(model, [without_labels(given[0])], SHARE, seed=0)[1][0]


def test_three_are_written_for_every_eight_examples_whatever_the_batch_size():
    model, given = tm.build("llama"), tm.batches("llama", n=8, batch=1)
    out, generated = with_generated(model, given, SHARE, seed=0)
    assert len(generated) == 3 and all(g["input_ids"].shape[0] == 1 for g in generated)
    # written where round(0.375 * examples so far) grows: after the 2nd, 4th and 7th example
    assert [i for i, b in enumerate(out) if any(b is g for g in generated)] == [2, 5, 9]


def test_the_same_seed_writes_the_same_text_and_leaves_the_callers_random_state():
    model, given = tm.build("llama"), tm.batches("llama", n=2, batch=8)
    torch.manual_seed(5)
    before = torch.rand(1)
    torch.manual_seed(5)
    once = with_generated(model, given, SHARE, seed=0)[1]
    assert torch.equal(torch.rand(1), before)
    torch.manual_seed(6)  # the draws come from the seed's own generator, not the global random state
    again = with_generated(model, given, SHARE, seed=0)[1]
    other = with_generated(model, given, SHARE, seed=1)[1]
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(once, again))
    assert not all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(once, other))


def test_a_rows_text_does_not_depend_on_the_rows_written_beside_it(monkeypatch):
    model = tm.build("llama")
    wide = written_batches(model, examples=5, batch_size=5, length=6, seed=0, progress=False)[0]["input_ids"]
    monkeypatch.setattr("prune_heads.recovery.generated.WRITE_TOKENS", 12)  # 2 rows at a time
    narrow = written_batches(model, examples=5, batch_size=5, length=6, seed=0, progress=False)[0]["input_ids"]
    assert torch.equal(wide, narrow)
    assert torch.equal(written_batches(model, 3, 3, 6, 0, progress=False)[0]["input_ids"], wide[:3])


def test_nucleus_keeps_the_most_likely_tokens_until_their_mass_reaches_top_p(monkeypatch):
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3], [0.97, 0.01, 0.01, 0.01]], dtype=torch.float64)
    as_lists = lambda found: [(v.tolist(), t.tolist()) for v, t in found]  # noqa: E731
    assert as_lists(nucleus(probs, 0.75)) == [([0.5, 0.3], [1, 3]), ([0.97], [0])]
    assert as_lists(nucleus(probs, 0.0)) == [([0.5], [1]), ([0.97], [0])]
    flat = torch.full((2, 4), 0.25)
    assert [len(v) for v, _ in nucleus(flat, 0.9)] == [4, 4]
    monkeypatch.setattr("prune_heads.recovery.generated.NUCLEUS_WIDTHS", (1, 2))  # each row found at its width
    assert as_lists(nucleus(probs, 0.75)) == [([0.5, 0.3], [1, 3]), ([0.97], [0])]
    assert [len(v) for v, _ in nucleus(flat, 0.9)] == [4, 4]


def test_a_draw_follows_the_nucleus_and_its_rows_generator(monkeypatch):
    monkeypatch.setattr("prune_heads.recovery.generated.TOP_P", 0.75)
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).repeat(4000, 1)
    drawn = draw(probs, [torch.Generator().manual_seed(i) for i in range(4000)]).squeeze(1)
    counts = torch.bincount(drawn, minlength=4)
    assert counts[0] == counts[2] == 0 and abs(counts[1] / 4000 - 0.5 / 0.8) < 0.03  # 4 standard errors
    again = draw(probs[:3], [torch.Generator().manual_seed(i) for i in range(3)]).squeeze(1)
    assert torch.equal(again, drawn[:3])


DECODERS = [name for name, family in tm.FAMILIES.items() if family[3] == "decoder"]


@pytest.mark.parametrize("name", DECODERS)
def test_sampling_with_the_kv_cache_follows_the_models_own_next_token(name, monkeypatch):
    model = tm.build(name)
    model.config.eos_token_id = [5, 7]
    monkeypatch.setattr("prune_heads.recovery.generated.TOP_P", 1e-6)  # only the most likely token: greedy
    written = sample(model, torch.tensor([[3], [9]]), 6, [torch.Generator().manual_seed(i) for i in range(2)])
    expected = torch.tensor([[3], [9]])
    for _ in range(6):  # the whole sequence each step, no cache
        logits = model(expected).logits[:, -1]
        logits[:, [5, 7]] = -torch.inf
        expected = torch.cat([expected, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(written, expected)


def test_the_end_of_text_tokens_are_never_written():
    model = tm.build("llama")
    model.config.eos_token_id = list(range(3, model.config.vocab_size))  # all but 0, 1 and 2 end the text
    written = sample(model, torch.tensor([[1]] * 4), 12, [torch.Generator().manual_seed(i) for i in range(4)])
    assert written.shape == (4, 13) and bool((written[:, 1:] < 3).all())


def run(name: str, **recovery) -> ph.PruneResult:
    recovery = {"general": "off", **recovery}  # the guard's own written text aside (tests/test_general.py)
    config = ph.PruneConfig(
        ph.SelectionConfig(num_heads=4), recovery=ph.RecoveryConfig(search_rounds=0, epochs=1, **recovery)
    )
    return ph.prune_model(tm.build(name), tm.batches(name, batch=8), config, progress=False)


@pytest.mark.slow
def test_generated_text_is_added_only_when_asked_and_its_work_is_counted():
    language_model = run("llama", generated_share=SHARE)
    examples = 5 * (8 + 3)  # 3 written beside each batch of 8 (round(0.375 * 8)), as wide (9 tokens)
    assert language_model.heldout["examples"] == examples // 5  # a fifth held out, written ones among them
    per_token = language_model.work.calibration_pass / 2 / (examples * 4 // 5 * 9)  # forward FLOPs
    assert language_model.work[Stage.GENERATION] == pytest.approx(per_token * 5 * 3 * 9)
    by_default = run("llama")
    assert Stage.GENERATION not in by_default.work and by_default.heldout["examples"] == 5 * 8 // 5
    assert "generation" not in run("bert").work


def test_a_share_asked_of_a_model_that_writes_no_text_or_with_recovery_off_is_refused_before_scoring():
    with pytest.raises(ConfigError, match="generated_share is 0.5, but only a decoder-only language model"):
        run("bert", generated_share=0.5)
    with pytest.raises(ConfigError, match="recovery.generated_share is -1; give 0 or more"):
        ph.RecoveryConfig(generated_share=-1)
    off = ph.RecoveryConfig.off()  # recovery off: nothing would use the text
    with pytest.raises(ConfigError, match="generated_share is 0.375, but recovery is off"):
        dataclasses.replace(off, generated_share=SHARE)
    assert dataclasses.replace(off, gate_tuning=True, generated_share=SHARE).generated_share == SHARE


def test_with_no_data_a_decoder_writes_its_calibration_batches_from_its_first_token():
    model = tm.build("llama")
    batches = written_batches(model, examples=5, batch_size=2, length=6, seed=0, progress=False)
    assert [b["input_ids"].shape for b in batches] == [(2, 6), (2, 6), (1, 6)]
    ids = torch.cat([b["input_ids"] for b in batches])
    assert (ids[:, 0] == model.config.bos_token_id).all() and len({tuple(row) for row in ids[:, 1:].tolist()}) == 5
    for batch in batches:
        assert torch.equal(batch["labels"], batch["input_ids"]) and bool(batch["attention_mask"].all())
    again = written_batches(model, examples=5, batch_size=2, length=6, seed=0, progress=False)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, again))
    other = written_batches(model, examples=5, batch_size=2, length=6, seed=1, progress=False)
    assert not torch.equal(ids, torch.cat([b["input_ids"] for b in other]))
    with pytest.raises(ph.DataError, match="--data is required: only a decoder-only language model"):
        written_batches(tm.build("bert"), examples=2, batch_size=2, length=6, seed=0, progress=False)
