import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tiny_models as tm
import torch
import transformers
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import prune_heads as ph


@pytest.mark.slow
@pytest.mark.parametrize("name", list(tm.FAMILIES))
def test_save_then_load_reproduces_outputs_exactly(name, tmp_path):
    model, inputs = tm.build(name), tm.make_inputs(name)
    ph.prune(model, tm.uneven_plan(ph.find_attention(model)))
    with torch.no_grad():
        expected = tm.main_output(model(**inputs))
    ph.save_pruned(model, tmp_path / "pruned")
    loaded = ph.load_pruned(tmp_path / "pruned", attn_implementation="eager")
    assert type(loaded) is type(model)
    with torch.no_grad():
        assert torch.equal(tm.main_output(loaded(**inputs)), expected)
    assert [l.heads for l in ph.find_attention(loaded)] == [l.heads for l in ph.find_attention(model)]


def test_save_pretrained_output_loads_too(tmp_path):
    model, inputs = tm.build("gpt2"), tm.make_inputs("gpt2")
    ph.prune(model, {0: [1, 2]})
    model.save_pretrained(tmp_path / "m")
    with torch.no_grad():
        expected = model(**inputs).logits
        assert torch.equal(ph.load_pruned(tmp_path / "m", attn_implementation="eager")(**inputs).logits, expected)
    loaded = ph.load_pruned(tmp_path / "m", attn_implementation="eager", dtype=torch.bfloat16)
    assert loaded.transformer.h[0].attn.num_heads == 2
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())


def test_existing_folder_is_not_overwritten(tmp_path):
    model = tm.build("bert")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ph.OutputExistsError, match="already exists"):
        ph.save_pruned(model, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    ph.save_pruned(model, tmp_path / "out", overwrite=True)
    assert not (tmp_path / "out" / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folders left


def test_empty_folder_is_accepted_and_modes_follow_the_umask(tmp_path):
    model = tm.build("bert")
    (tmp_path / "out").mkdir()
    ph.save_pruned(model, tmp_path / "out")  # empty: no overwrite needed, as save_pretrained allows
    old = os.umask(0o027)
    try:
        ph.save_pruned(model, tmp_path / "fresh")
    finally:
        os.umask(old)
    assert (tmp_path / "fresh").stat().st_mode & 0o777 == 0o750
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "out"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ph.OutputExistsError, match="is a file"):
        ph.save_pruned(model, tmp_path / "file", overwrite=True)


def test_overwriting_a_mount_point_replaces_its_entries(tmp_path, monkeypatch):
    model = tm.build("bert")
    target = tmp_path / "mnt"
    target.mkdir()
    (target / "old.txt").write_text("old")
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == target or real(p))
    ph.save_pruned(model, target, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnt"]  # no .old folder beside it


WRITER = """
import sys, torch, transformers as T, prune_heads as ph
config = T.BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=64, num_hidden_layers=1,
                      vocab_size=60000)
for version in range(1000):
    model = T.BertModel(config)
    torch.nn.init.constant_(model.embeddings.word_embeddings.weight, version)
    model.config.version = version
    ph.save_pruned(model, sys.argv[1], overwrite=True)
    print(version, flush=True)
"""


@pytest.mark.slow
def test_a_killed_save_leaves_the_old_folder_or_the_new_one(tmp_path):
    target, rng = tmp_path / "out", random.Random(0)
    for attempt in range(4):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline()  # one save done: from now on the folder always exists
        time.sleep(rng.uniform(0.0, 0.5))
        writer.kill()
        writer.wait()
        model = ph.load_pruned(target)  # complete, and config and weights from the same save
        assert model.embeddings.word_embeddings.weight[0, 0].item() == model.config.version, attempt
    ph.save_pruned(model, target, overwrite=True)  # the next save removes what the killed ones left
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_the_next_save_removes_temporary_folders_of_dead_writers_only(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    left = [tmp_path / f".out.{dead}.k3j_x9a1", tmp_path / f".out.old.{dead}.q0w_e8r2"]
    live = tmp_path / f".out.{os.getpid()}.writing"  # a save still under way in a live process
    for folder in (*left, live):
        folder.mkdir()
        (folder / "model.safetensors").write_text("partial")
    ph.save_pruned(tm.build("bert"), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "out"])


def test_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    model = tm.build("bert")

    def broken(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model, "save_pretrained", broken)
    with pytest.raises(KeyboardInterrupt):
        ph.save_pruned(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_fixture_half_heads_round_trip_in_a_fresh_process(fixture_model_path, fixture_data_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(fixture_model_path)
    model = AutoModelForSequenceClassification.from_pretrained(fixture_model_path).eval()
    lines = (fixture_data_path / "validation.jsonl").read_text().splitlines()[:48]
    sentences = [json.loads(line)["sentence"] for line in lines]
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=128, return_tensors="pt")
    layers = ph.find_attention(model)
    plan = {layer.index: list(range(layer.index % 2, 12, 2)) for layer in layers}  # half of every layer
    with ph.head_gates(model) as gates, torch.no_grad():
        for i, heads in plan.items():
            gates[i][heads] = 0.0
        gated = model(**batch).logits
    params = sum(p.numel() for p in model.parameters())
    ph.prune(model, plan)
    with torch.no_grad():
        pruned = model(**batch).logits
    ph.save_pruned(model, tmp_path / "pruned", tokenizer=tokenizer)
    torch.save(dict(batch), tmp_path / "batch.pt")
    script = (
        "import sys, torch, prune_heads as ph\n"
        f"m = ph.load_pruned(r'{tmp_path / 'pruned'}').eval()\n"
        f"b = torch.load(r'{tmp_path / 'batch.pt'}')\n"
        "with torch.no_grad(): logits = m(**b).logits\n"
        f"torch.save((logits, m.state_dict()), r'{tmp_path / 'out.pt'}')\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
    logits, loaded_state = torch.load(tmp_path / "out.pt")
    state = model.state_dict()
    assert loaded_state.keys() == state.keys()
    assert all(torch.equal(loaded_state[k], state[k]) for k in state)  # the weights round-trip bit for bit
    assert sum(p.numel() for p in model.parameters()) < params
    # Another process may take other CPU kernel paths (memory alignment of the loaded weights), so its outputs
    # differ by float noise, seen up to 4e-5 on these logits; a wrong weight would move them by 1e-1.
    torch.testing.assert_close(logits, pruned, rtol=0, atol=5e-4)
    assert torch.equal(pruned.argmax(-1), gated.argmax(-1))
    torch.testing.assert_close(pruned, gated, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2"])
def test_uniform_llama_style_plans_save_a_stock_config(name, tmp_path):
    from transformers import AutoModelForCausalLM

    model, inputs = tm.build(name), tm.make_inputs(name)
    ph.prune(model, {i: [0, 1] for i in range(3)})  # one of two KV groups in every layer
    ph.save_pruned(model, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (2, 1, 8)
    assert "prune_heads" not in config and config["pruned_from"]["format"] == 1
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(plain(**inputs).logits, model(**inputs).logits)
    assert torch.equal(
        plain.generate(**inputs, max_new_tokens=5, do_sample=False),
        model.generate(**inputs, max_new_tokens=5, do_sample=False),
    )
    assert model.config.prune_heads["format"] == 1  # the model in memory keeps its record


@pytest.mark.parametrize("name, stock", [("llama", True), ("qwen2", False)])
def test_added_output_biases_stay_stock_where_the_config_can_say_so(name, stock, tmp_path):
    from transformers import AutoModelForCausalLM

    from prune_heads.model.surgery import add_output_bias

    model, inputs = tm.build(name), tm.make_inputs(name)
    ph.prune(model, {i: [0, 1] for i in range(3)})
    add_output_bias(model, {l.name: torch.full((32,), 0.1 * (l.index + 1)) for l in ph.find_attention(model)})
    ph.save_pruned(model, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert ("prune_heads" not in config) == stock
    with torch.no_grad():
        expected = model(**inputs).logits
        if stock:  # Llama reads attention_bias for o_proj: q/k/v get zero biases, no code of ours needed
            assert config["attention_bias"] is True
            plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
            assert torch.equal(plain(**inputs).logits, expected)
        # Qwen2's o_proj never has a bias in its config: the record keeps it, load_pruned re-creates it
        loaded = ph.load_pruned(tmp_path / "m", attn_implementation="eager")
        assert torch.equal(loaded(**inputs).logits, expected)


def test_uneven_plans_keep_the_record(tmp_path):
    model = tm.build("llama")
    ph.prune(model, {0: [0, 1]})
    ph.save_pruned(model, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["num_attention_heads"] == 4 and "prune_heads" in config


def _saved_with_record(tmp_path, name="llama"):
    model = tm.build(name)
    ph.prune(model, {0: [0, 1], 1: [2, 3]})
    ph.save_pruned(model, tmp_path / "saved")
    return tmp_path / "saved"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r, e: e.update(removed=[0, 1, 9]), r"removed head\(s\) \[9\] are not heads 0..3"),
        (lambda r, e: e.update(removed=[-1, 0]), r"removed head\(s\) \[-1\] are not heads 0..3"),
        (lambda r, e: e.update(removed=[0, 0]), "lists a head twice"),
        (lambda r, e: e.update(removed=["0", 1]), r"removed head\(s\) \['0'\]"),
        (lambda r, e: e.pop("removed"), "no 'removed' list"),
        (lambda r, e: e.update(num_heads=8), "records num_heads 8, the model builds 4"),
        (lambda r, e: e.update(removed=[0]), "leaves KV groups of different sizes"),
        (lambda r, e: e.update(removed=[2, 3]), "edited after saving"),
        (lambda r, e: (e.update(removed=[2, 3]), r.pop("digest")), None),  # no digest, same shapes: loads as said
        (lambda r, e: (e.update(removed=[]), r.pop("digest")), r"q_proj.weight is \[16, 32\] in the checkpoint"),
    ],
)
def test_an_edited_record_is_refused_naming_the_layer(tmp_path, edit, message):
    saved = _saved_with_record(tmp_path)
    config = json.loads((saved / "config.json").read_text())
    record = config["prune_heads"]
    edit(record, record["layers"]["model.layers.0.self_attn"])
    (saved / "config.json").write_text(json.dumps(config))
    if message is None:
        assert list(ph.find_attention(ph.load_pruned(saved))[0].heads) == [0, 1]
        return
    with pytest.raises(ph.RecordError, match=message) as error:
        ph.load_pruned(saved)
    assert "model.layers.0.self_attn" in str(error.value) or "digest" in str(error.value)
    assert "restore the config.json" in str(error.value)


def test_a_missing_folder_is_not_sent_to_the_hub(tmp_path):
    for path in (tmp_path / "nope", "./nope", "~/nope"):
        with pytest.raises(ph.ModelNotFoundError, match=r"no folder .*nope, and not a hub id"):
            ph.load_pruned(path)


@pytest.mark.skipif(not hasattr(transformers, "GradiumPhononTTSModel"), reason="a transformers without Gradium")
def test_a_model_whose_original_layout_permutes_rows_by_head_count_saves_and_loads(tmp_path):
    """Gradium's checkpoint layout fuses q/k/v and interleaves RoPE pairs; transformers' conversion back to it
    permutes rows by the config's head count, which a pruned layer no longer has: saved in transformers' own
    layout instead, it loads with the same outputs."""
    config = transformers.GradiumPhononTTSConfig(num_hidden_layers=2, intermediate_size=64, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.GradiumPhononTTSModel(config).eval()
    assert ph.export.persistence.head_bound(model)
    ids = torch.randint(8, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    ph.prune(model, {0: [0, 1], 1: [5]})
    with torch.no_grad():
        expected = model(input_ids=ids).last_hidden_state
    ph.save_pruned(model, tmp_path / "m")
    loaded = ph.load_pruned(tmp_path / "m").eval()
    assert [layer.num_heads for layer in ph.find_attention(loaded)] == [10, 11]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).last_hidden_state, expected, rtol=0, atol=1e-5)


def test_a_gguf_source_path_travels_beside_the_config_not_in_it(tmp_path):
    model = tm.build("llama")
    model.gguf_source = "/models/source.gguf"  # as load_pruned(..., gguf_file=) sets it
    ph.save_pruned(model, tmp_path / "new")
    assert "gguf_source" not in (tmp_path / "new" / "config.json").read_text()
    assert ph.load_pruned(tmp_path / "new").gguf_source == "/models/source.gguf"
    old = tm.build("llama")
    old.config.gguf_source = "/models/old.gguf"  # a folder saved when the path was kept in the config
    old.save_pretrained(tmp_path / "old")
    loaded = ph.load_pruned(tmp_path / "old")
    assert loaded.gguf_source == "/models/old.gguf" and not hasattr(loaded.config, "gguf_source")
