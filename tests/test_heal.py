"""Healing (`recovery.heal`): the pruned model distilled toward the unpruned one over a token budget, kept only
where held-out data improves; its checkpoints resume to the same model, and bad input is refused before work."""

import dataclasses

import pytest
import tiny_models as tm
import torch

import prune_heads as ph
from prune_heads.config import parse_tokens
from prune_heads.errors import ConfigError
from prune_heads.recovery import heal as healing
from prune_heads.runtime.ledger import Stage
from prune_heads.task_data import DataError

TOKENS = 400  # 11 steps of the tiny decoder's batches (4 rows x 9 positions)


def _heal(name="llama", n=6, model=None, data=None, **recovery):
    """The tiny model pruned by the default path at 4 heads with a heal of `TOKENS` (and `recovery`), and the
    result."""
    model = model or tm.build(name)
    resume = recovery.pop("resume", False)
    config = ph.PruneConfig(ph.SelectionConfig(num_heads=4), recovery=ph.RecoveryConfig(**{"heal": TOKENS, **recovery}))
    result = ph.prune_model(model, data or tm.batches(name, n=n), config, progress=False, resume=resume)
    return model, result


def _entry(result) -> dict:
    return next(e for e in result.recovery if e["step"] == "healing")


def _weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_token_counts_take_suffixes_and_refuse_the_rest():
    assert [parse_tokens(v) for v in (2000000, "2M", "250k", "1.5M", "0")] == [2000000, 2000000, 250000, 1500000, 0]
    for bad in ("-5", "2G", "1.5", "lots", True):
        with pytest.raises(ConfigError, match="give a whole number of tokens"):
            parse_tokens(bad)
    assert ph.RecoveryConfig(heal="2M").heal == 2_000_000
    with pytest.raises(ConfigError, match="recovery is off"):
        dataclasses.replace(ph.RecoveryConfig.off(), heal=1000)


@pytest.mark.slow
def test_a_heal_lowers_the_divergence_on_both_held_out_texts_and_counts_its_work():
    """On the tiny Llama, healing lowers the divergence from the unpruned model on the calibration's held-out
    text and on the model's own, is kept, trains on exactly the steps its budget holds (the calibration a third
    of the rows at least) and counts its work in the ledger where it is spent."""
    model, result = _heal()
    entry = _entry(result)
    held = entry["heldout"]
    assert held["general"]["after"] < held["general"]["before"] and entry["kept"]
    assert held["calibration"]["after"] < held["calibration"]["before"]
    assert entry["tokens"] == entry["steps"] * 4 * 9 <= TOKENS < (entry["steps"] + 1) * 4 * 9
    rows = entry["rows"]
    assert rows["written"] > 0 and rows["corpus"] == 0
    assert rows["calibration"] * rows["calibration_repeats"] >= rows["written"] / 2
    work = result.work
    assert work[Stage.HEALING] > entry["tokens"] * 3 * work.calibration_pass / (2 * 20 * 9)  # student x3 at least
    assert result.heldout["final"] == pytest.approx(held["calibration"]["after"])
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())  # as they were
    assert not model.training
    model.generate(torch.tensor([[1, 5, 7]]), max_new_tokens=3, do_sample=False)


@pytest.mark.slow
def test_the_same_inputs_heal_to_the_same_model_and_leave_the_random_state_alone():
    model, data = tm.build("llama"), tm.batches("llama", n=6)  # the tiny model's build seeds torch
    with tm.random_state_kept():
        a, _ = _heal(model=model, data=data)
    b, _ = _heal()
    assert _same(_weights(a), _weights(b))


@pytest.mark.slow
def test_a_resumed_heal_gives_the_model_an_uninterrupted_one_gives(tmp_path, monkeypatch):
    """A heal stopped after its first checkpoint (step 6 of 11) resumes from it with --resume to the same
    weights, bit for bit, as one run straight through; its written text is read back, not written again."""
    straight, _ = _heal(heal_every=150, heal_checkpoints=str(tmp_path / "straight"))
    from transformers import Trainer

    step, calls = Trainer.training_step, []

    def stopped(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 8:
            raise KeyboardInterrupt  # as a signal stops it
        return step(self, *args, **kwargs)

    folder = tmp_path / "stopped"
    monkeypatch.setattr(Trainer, "training_step", stopped)
    with pytest.raises(KeyboardInterrupt):
        _heal(heal_every=150, heal_checkpoints=str(folder))
    monkeypatch.setattr(Trainer, "training_step", step)
    assert (folder / "checkpoint-4" / healing.DONE).exists() and (folder / healing.WRITTEN).exists()
    monkeypatch.setattr(healing, "written_batches", lambda *a, **k: pytest.fail("wrote the text again"))
    resumed, result = _heal(heal_every=150, heal_checkpoints=str(folder), resume=True)
    assert _entry(result)["resumed_at_step"] == 4
    assert _same(_weights(straight), _weights(resumed))


def test_checkpoint_folders_another_run_cannot_use_are_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr("prune_heads.pruner.flow.score_heads", lambda *a, **k: pytest.fail("scored"))
    with pytest.raises(ConfigError, match="nothing to resume in"):
        _heal(heal_checkpoints=str(tmp_path / "none"), resume=True)
    with pytest.raises(ConfigError, match="--resume continues a heal's checkpoints"):
        _heal(heal=0, resume=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty and holds no heal checkpoints"):
        _heal(heal_checkpoints=str(tmp_path / "other"))
    folder = tmp_path / "run"
    healing.check_checkpoints(folder, "abc", resume=False)  # a new folder is fine
    folder.mkdir()
    (folder / healing.FINGERPRINT).write_text('{"fingerprint": "abc"}')
    with pytest.raises(ConfigError, match="give --resume to continue that run"):
        _heal(heal_checkpoints=str(folder))
    with pytest.raises(ConfigError, match="the checkpoints of another run"):
        _heal(heal_checkpoints=str(folder), resume=True)


def test_a_budget_below_one_batch_or_a_model_it_cannot_train_is_refused_before_any_work(monkeypatch):
    monkeypatch.setattr("prune_heads.pruner.flow.score_heads", lambda *a, **k: pytest.fail("scored"))
    with pytest.raises(ConfigError, match=r"below one batch \(4 x 9 = 36 tokens\): give at least 36"):
        _heal(heal=35)
    with pytest.raises(ConfigError, match="recovery.heal trains on batches of token ids"):
        _heal("t5")
    with pytest.raises(DataError, match="the heal corpus .* has no examples"):
        config = ph.PruneConfig(ph.SelectionConfig(num_heads=4), recovery=ph.RecoveryConfig(heal=TOKENS))
        ph.prune_model(tm.build("llama"), tm.batches("llama"), config, progress=False, heal_data=[])


def test_a_heal_corpus_takes_the_place_of_the_written_text():
    corpus = tm.batches("llama", n=3)
    config = ph.PruneConfig(ph.SelectionConfig(num_heads=4), recovery=ph.RecoveryConfig(heal=TOKENS))
    result = ph.prune_model(tm.build("llama"), tm.batches("llama", n=6), config, progress=False, heal_data=corpus)
    rows = _entry(result)["rows"]
    assert rows["corpus"] == 12 and rows["written"] == 0
    assert _entry(result)["kept"]


@pytest.mark.slow
def test_a_heal_that_does_not_help_on_held_out_data_is_put_back(monkeypatch):
    """At a learning rate that wrecks the model, the healed weights measure worse on held-out data, and the
    model is the un-healed one again, weight for weight (the same as a run without a heal)."""
    monkeypatch.setattr(healing, "LEARNING_RATE", 5.0)
    model, result = _heal()
    assert not _entry(result)["kept"]
    plain, _ = _heal(heal=0)
    assert _same(_weights(model), _weights(plain))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "xlm-roberta"])
def test_classifiers_and_embedding_models_heal_on_their_own_losses(name):
    """A classifier (tiny BERT) heals on its logits' KL and its labels' cross-entropy, an embedding model (tiny
    XLM-R without a head) on cosine and the neighbour divergence (no text written); each is kept only where the
    held-out calibration text improves."""
    model = tm.sensitive(tm.build(name)) if name == "bert" else tm.build(name)
    data = tm.batches(name, n=8, labels=name == "bert")
    _, result = _heal(name, model=model, data=data, heal=4 * 9 * 8)
    entry = _entry(result)
    assert entry["rows"]["written"] == 0 and set(entry["heldout"]) == {"calibration"}
    held = entry["heldout"]["calibration"]
    assert entry["kept"] == (held["after"] < held["before"])


@pytest.mark.slow
def test_adapters_heal_and_merge_back_into_a_plain_model(monkeypatch):
    """`heal_rank` trains peft's LoRA adapters and merges them back: the model has no adapter left, its weights
    moved, and the divergence fell; healing every weight where its Adam state cannot fit is refused before any
    work, naming the adapters."""
    model, result = _heal(heal_rank=4)
    assert not any("lora" in name for name in model.state_dict()) and type(model).__name__ == "LlamaForCausalLM"
    held = _entry(result)["heldout"]["general"]
    assert held["after"] < held["before"]
    plain, _ = _heal(heal=0)
    assert not _same(_weights(model), _weights(plain))
    monkeypatch.setattr(healing, "TRAINING_BYTES", 2**50)
    monkeypatch.setattr("prune_heads.pruner.flow.score_heads", lambda *a, **k: pytest.fail("scored"))
    with pytest.raises(ConfigError, match="give --heal-rank 64"):
        _heal()


@pytest.mark.slow
def test_a_model_read_from_gguf_heals_and_stays_marked_as_it_was():
    """transformers marks a model read from a GGUF file quantized though its weights are plain (the Trainer
    refuses such a model): the heal trains it and leaves the marks as they were, for the writers to read."""
    from types import SimpleNamespace

    model = tm.build("llama")
    quantizer = SimpleNamespace(quantization_config=SimpleNamespace(quant_method="gguf"), is_trainable=False)
    model.is_quantized, model.hf_quantizer = True, quantizer
    model.config.quantization_config = {"quant_method": "gguf"}
    _, result = _heal(model=model)
    assert _entry(result)["steps"] == 11
    assert model.is_quantized and model.hf_quantizer is quantizer
    assert model.config.quantization_config == {"quant_method": "gguf"}
