import inspect

import pytest
import tiny_models as tm
import torch

import prune_heads as ph
from prune_heads.evaluation.report import heatmap
from prune_heads.scoring.methods import scoring_passes

DATA_METHODS = ["gradient", "taylor", "fisher", "activation", "ablation"]


def classifier_batches(n_batches=3, batch=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(3, 128, (batch, 9), generator=g)
        mask = torch.ones_like(ids)
        mask[0, -3:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (batch,), generator=g)})
    return out


def mean_loss_with_gates(model, batches, layer=None, head=None):
    total, n = 0.0, 0
    with ph.head_gates(model, requires_grad=False) as gates, torch.no_grad():
        if layer is not None:
            gates[layer][head] = 0.0
        for b in batches:
            logits = model(**{k: v for k, v in b.items() if k != "labels"}).logits
            total += float(torch.nn.functional.cross_entropy(logits, b["labels"], reduction="sum"))
            n += len(b["labels"])
    return total / n


def test_ablation_scores_equal_the_measured_loss_increase():
    model, batches = tm.build("bert"), classifier_batches()
    scores = ph.score_heads(model, batches, method="ablation", progress=False)
    base = mean_loss_with_gates(model, batches)
    for i, name in enumerate(scores.layers):
        for h in range(4):
            expected = mean_loss_with_gates(model, batches, i, h) - base
            assert abs(float(scores.scores[name][h]) - expected) < 1e-5
    assert scores.num_examples == 12


def test_per_example_fisher_equals_sum_of_single_example_squared_gradients():
    model, batches = tm.build("bert"), classifier_batches(n_batches=2, batch=3)
    scores = ph.score_heads(model, batches, method="fisher", progress=False)
    expected = [torch.zeros(4, dtype=torch.float64) for _ in range(3)]
    for b in batches:
        for j in range(3):
            single = {k: v[j : j + 1] for k, v in b.items()}
            with ph.head_gates(model) as gates:
                out = model(**single)
                grads = torch.autograd.grad(out.loss, list(gates))
            for i, g in enumerate(grads):
                expected[i] += g.double() ** 2
    for i, name in enumerate(scores.layers):
        torch.testing.assert_close(scores.scores[name].double(), expected[i], rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("method", DATA_METHODS + ["magnitude"])
def test_a_head_with_zero_output_columns_scores_lowest(method):
    model, batches = tm.build("bert"), classifier_batches()
    with torch.no_grad():
        model.bert.encoder.layer[1].attention.output.dense.weight[:, 16:24] = 0.0  # head 2 of layer 1
    scores = ph.score_heads(model, batches, method=method, progress=False)
    layer = scores.scores[scores.layers[1]]
    if method == "ablation":  # a signed loss increase: removing a head may also lower the loss a little
        layer = layer.abs()
    assert int(layer.argmin()) == 2
    assert float(layer[2]) == pytest.approx(0.0, abs=1e-7)


def test_gradient_scores_are_layer_normalised_and_have_variance():
    scores = ph.score_heads(tm.build("bert"), classifier_batches(), method="gradient", progress=False)
    for name in scores.layers:
        assert float(scores.scores[name].norm()) == pytest.approx(1.0, abs=1e-5)
        assert scores.variance[name].shape == (4,) and bool((scores.variance[name] >= 0).all())
    raw = ph.score_heads(tm.build("bert"), classifier_batches(), method="gradient", normalize=False, progress=False)
    assert float(raw.scores[raw.layers[0]].norm()) != pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("name, model_kind", [("llama", "decoder"), ("bert", "encoder")])
def test_label_free_scoring_works_without_labels(name, model_kind):
    model = tm.build(name)
    if model_kind == "encoder":
        model = model.bert  # no head: the pooled-embedding objective
    batches = [tm.make_inputs(name, batch=3, seed=s) for s in range(2)]
    first = ph.score_heads(model, batches, method="fisher", seed=3, progress=False)
    again = ph.score_heads(model, batches, method="fisher", seed=3, progress=False)
    assert all(torch.equal(first.scores[n], again.scores[n]) for n in first.layers)  # deterministic
    assert all(float(first.scores[n].sum()) > 0 for n in first.layers)
    ablation = ph.score_heads(model, batches, method="ablation", progress=False)
    assert all(bool((ablation.scores[n] >= -1e-6).all()) for n in ablation.layers)  # a divergence grows


def test_custom_loss_and_parameters_are_restored():
    model, batches = tm.build("bert"), classifier_batches()
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    scores = ph.score_heads(
        model, batches, method="gradient", loss=lambda out, b: out.logits[:, 1].mean(), progress=False
    )
    assert scores.num_examples == 12
    assert not model.bert.embeddings.word_embeddings.weight.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if "word_embeddings" not in n)
    assert all(p.grad is None for p in model.parameters())


def test_scores_of_a_pruned_model_skip_removed_heads(tmp_path):
    model, batches = tm.build("bert"), classifier_batches()
    ph.prune(model, {0: [1, 3]})
    scores = ph.score_heads(model, batches, method="random", progress=False)
    assert scores.heads[scores.layers[0]] == (0, 2) and scores.scores[scores.layers[0]].shape == (2,)
    scores.save(tmp_path / "s.json")
    loaded = ph.HeadScores.load(tmp_path / "s.json")
    assert loaded.to_dict() == scores.to_dict()
    png = heatmap(loaded, tmp_path / "heat.png", removed={scores.layers[1]: [0]})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert torch.isnan(loaded.matrix()[0, 1])


def test_fluctuation_is_flap_standardised_per_layer():
    model, batches = tm.build("llama"), [tm.make_inputs("llama", batch=4, seq=9, seed=s) for s in range(2)]
    scores = ph.score_heads(model, batches, method="fluctuation", progress=False)
    for name in scores.layers:  # a KV group's heads share its standardised value: zero mean over the groups
        values = scores.scores[name].reshape(2, 2)
        assert torch.allclose(values[:, 0], values[:, 1])
        assert abs(float(values.sum())) < 1e-5
    pruned = tm.build("llama")
    ph.prune(pruned, {0: [0, 1]})
    assert ph.score_heads(pruned, batches, method="fluctuation", progress=False).scores[scores.layers[0]].tolist() == [
        0.0,
        0.0,
    ]  # one group left: nothing to compare it with


def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown scoring method 'nope'; choose one of ablation, activation"):
        ph.score_heads(tm.build("bert"), classifier_batches(), method="nope")


def test_prune_iteratively_records_a_curve():
    model, batches = tm.build("bert"), classifier_batches()
    result = ph.prune_iteratively(
        model,
        batches,
        0.5,
        steps=3,
        progress=False,
        evaluate=lambda m: {"params": sum(p.numel() for p in m.parameters())},
    )
    assert [h["heads_removed"] for h in result.history] == [0, 2, 4, 6]
    assert all(h["loss"] is not None for h in result.history)
    assert result.history[0]["params"] > result.history[-1]["params"]
    assert sum(l.num_heads for l in ph.find_attention(model)) == 6
    assert sum(len(h) for h in result.plan.values()) == 6


def _labelled(name: str, batches: int = 3) -> list[dict]:
    out = []
    for seed in range(batches):
        x = tm.make_inputs(name, batch=4, seed=seed)
        x["labels"] = x["input_ids"].clone() if tm.FAMILIES[name][3] == "decoder" else torch.tensor([0, 1, 1, 0])
        out.append(x)
    return out


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_bf16_models_score_like_float32_ones(name):
    model, batches = tm.build(name), _labelled(name)
    expected = ph.score_heads(model, batches, method="fisher", progress=False)
    scores = ph.score_heads(model.to(torch.bfloat16), batches, method="fisher", progress=False)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for n in expected.layers:  # float32 gates, float64 sums: only the bf16 forward differs
        assert scores.scores[n].dtype == torch.float32
        torch.testing.assert_close(
            scores.scores[n], expected.scores[n], rtol=0.05, atol=0.05 * expected.scores[n].abs().max().item()
        )


def test_models_loaded_with_a_device_map_score_and_refuse_pruning_offloaded_layers(tmp_path):
    from transformers import AutoModelForCausalLM

    model, batches = tm.build("llama"), _labelled("llama")
    model.save_pretrained(tmp_path / "m")
    expected = ph.score_heads(model, batches, method="fisher", progress=False)
    placement = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.layers.2": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "m", device_map=placement, attn_implementation="eager", offload_folder=str(tmp_path / "offload")
    )
    assert next(offloaded.model.layers[1].parameters()).device.type == "meta"
    scores = ph.score_heads(offloaded, batches, method="fisher", progress=False)
    for n in expected.layers:
        torch.testing.assert_close(scores.scores[n], expected.scores[n])
    with pytest.raises(ph.PlanError, match="model.layers.1.self_attn is offloaded"):
        ph.prune(offloaded, {1: [0, 1]})
    with pytest.raises(ValueError, match="leave device unset"):
        ph.score_heads(offloaded, batches, device="cpu", progress=False)
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map="auto", attn_implementation="eager")
    ph.prune(auto, {0: [0, 1], 2: [2, 3]})
    ph.prune(model, {0: [0, 1], 2: [2, 3]})
    inputs = tm.make_inputs("llama")
    assert torch.equal(
        auto.generate(**inputs, max_new_tokens=4, do_sample=False),
        model.generate(**inputs, max_new_tokens=4, do_sample=False),
    )


def test_an_encoder_without_a_head_is_scored_on_its_labels_through_a_probe():
    """A feature-extraction TaskData with targets: the heads are scored on a logistic regression's loss fitted
    on the unpruned embeddings (the model is never given the labels), deterministically, and the scores differ
    from the label-free ones; prune_model uses it too, and iterative pruning stays label-free."""
    encoder = tm.build("bert").bert
    batches = [tm.make_inputs("bert", batch=6, seed=s) for s in range(4)]
    targets = [int(b["input_ids"][i, 1]) % 2 for b in batches for i in range(6)]
    data = ph.TaskData("feature-extraction", batches, 24, ["even", "odd"], targets=targets)
    labelled = ph.score_heads(encoder, data, method="fisher", progress=False)
    again = ph.score_heads(encoder, data, method="fisher", progress=False)
    label_free = ph.score_heads(encoder, data.without_labels(), method="fisher", progress=False)
    assert all(torch.equal(labelled.scores[n], again.scores[n]) for n in labelled.layers)
    assert not all(torch.allclose(labelled.scores[n], label_free.scores[n]) for n in labelled.layers)
    config = ph.PruneConfig(selection=ph.SelectionConfig(sparsity=0.5), recovery=ph.RecoveryConfig.off())
    found = ph.prune_model(tm.build("bert").bert, data, config, progress=False)
    assert found.plan == ph.select_heads(labelled, sparsity=0.5)
    iterative = ph.prune_iteratively(tm.build("bert").bert, data, 0.5, steps=2, progress=False)
    assert sum(map(len, iterative.plan.values())) == 6
    default = ph.prune_model(tm.build("bert").bert, data, ph.PruneConfig(), progress=False)
    assert default.heads_removed == 6 and [e["step"] for e in default.recovery][1] == "selection"  # after a note


def test_one_default_method_everywhere_and_each_method_priced_in_passes():
    default = ph.PruneConfig().scoring.method
    assert inspect.signature(ph.score_heads).parameters["method"].default == default == "fisher"
    assert inspect.signature(ph.prune_iteratively).parameters["method"].default == default
    layers = ph.find_attention(tm.build("bert"))
    heads = sum(l.num_heads for l in layers)
    passes = {name: scoring_passes(name, layers) for name in ph.METHODS}
    assert passes == {
        "gradient": 2,
        "taylor": 2,
        "fisher": 2,  # a forward pass and a backward one through the gates
        "activation": 1,
        "fluctuation": 1,
        "magnitude": 0,
        "random": 0,
        "ablation": 1 + heads,  # the plain pass, then one per head gated off
    }


def test_a_registered_name_is_refused_and_a_new_method_reaches_the_cli_and_recipes(monkeypatch):
    """`@method` refuses a name registered already (as peft's registry does); a method registered after import
    is a `--method` choice and a recipe's `scoring.method` value, with no restart."""
    from click.testing import CliRunner

    from prune_heads.cli import main
    from prune_heads.recipes import parse_recipe
    from prune_heads.scoring import methods

    with pytest.raises(ph.ConfigError, match="'fisher' is registered already"):
        methods.method("fisher")(lambda run: None)
    monkeypatch.setitem(methods.METHODS, "mine", methods.METHODS["random"])
    recipe = parse_recipe({"model": "m", "selection": {"sparsity": 0.5}, "scoring": {"method": "mine"}})
    assert recipe.scoring.method == "mine"
    result = CliRunner().invoke(main, ["score", "missing-model", "--data", "d.csv", "--method", "mine"])
    assert "Invalid value for '--method'" not in result.output
    result = CliRunner().invoke(main, ["score", "missing-model", "--data", "d.csv", "--method", "yours"])
    assert "Invalid value for '--method'" in result.output and "mine" in result.output


def test_scoring_leaves_the_callers_random_state_as_it_was():
    """Scoring seeds its own draws; the process's torch generator is the caller's again afterwards."""
    model, data = tm.build("bert"), tm.batches("bert", n=2)
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    ph.score_heads(model, data, method="fisher", seed=0, progress=False)
    assert torch.equal(torch.get_rng_state(), state)
