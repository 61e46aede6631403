import copy
import math

import pytest
import tiny_models as tm
import torch

import prune_heads as ph
from prune_heads.model.layers import output_projection
from prune_heads.recovery.holdout import split_holdout
from prune_heads.recovery.reconstruction import reconstruct, refit
from prune_heads.scoring.objective import Objective
from prune_heads.scoring.recording import record
from prune_heads.scoring.selection import plan_with_interactions


def calibration(name="bert", n=3):
    return [tm.make_inputs(name, batch=4, seq=9, seed=s) for s in range(n)]


def layer_outputs(model, layer_index, batches):
    """Output-projection outputs of one layer over the calibration tokens (padding dropped)."""
    o_proj = ph.find_attention(model)[layer_index]
    module = o_proj.module.get_submodule(o_proj.spec.o)
    rows = []
    handle = module.register_forward_hook(lambda m, a, out: rows.append(out.detach()))
    with torch.no_grad():
        for b in batches:
            model(**b)
    handle.remove()
    return torch.cat([r[b["attention_mask"].bool()] for r, b in zip(rows, batches)])


def pruned_pair(name="bert"):
    reference = tm.build(name)
    model = copy.deepcopy(reference)
    ph.prune(model, {0: [1, 3]})  # only layer 0: its inputs are the reference's
    return reference, model


def test_reconstruct_lowers_the_layer_s_error_and_is_the_default_path_s_refit():
    reference, model = pruned_pair()
    batches = calibration(n=6)
    target = layer_outputs(reference, 0, batches)
    before = (layer_outputs(model, 0, batches) - target).pow(2).sum(-1).mean()
    report = reconstruct(model, reference, batches)
    after = (layer_outputs(model, 0, batches) - target).pow(2).sum(-1).mean()
    assert set(report) == {"bert.encoder.layer.0.attention"} and after < before
    # the refit prune_model makes: the same Gram matrices (the reference's), the same ridge rule
    calib, held = split_holdout(batches, 0.2)
    moments = [record(reference, part, Objective(reference), gram=True).moments[0] for part in (calib, held)]
    fitted = refit(ph.find_attention(reference)[0], [1, 3], *moments)
    projection = output_projection(ph.find_attention(model)[0])
    assert torch.equal(projection.matrix(), fitted.weight)
    assert report["bert.encoder.layer.0.attention"]["ridge"] == fitted.ridge


def test_an_emptied_layer_gets_bias_compensation_which_restores_the_mean_output():
    reference = tm.build("bert")
    model = copy.deepcopy(reference)
    ph.prune(model, {0: [0, 1, 2, 3]})
    batches = calibration()
    target = layer_outputs(reference, 0, batches).mean(0)
    report = reconstruct(model, reference, batches, holdout=0.0)
    assert math.isinf(report["bert.encoder.layer.0.attention"]["ridge"])
    torch.testing.assert_close(layer_outputs(model, 0, batches).mean(0), target, rtol=0, atol=1e-5)


def test_reconstruct_refits_every_pruned_layer_and_leaves_the_others():
    reference = tm.build("gpt2")
    model = copy.deepcopy(reference)
    ph.prune(model, {0: [0, 1, 2, 3], 1: [2]})
    untouched = copy.deepcopy(model.transformer.h[2].attn.state_dict())
    report = reconstruct(model, reference, calibration("gpt2", n=5))
    assert set(report) == {"transformer.h.0.attn", "transformer.h.1.attn"}
    assert all(math.isfinite(r["relative_error"]) and r["fallback"] is None for r in report.values())
    assert all(torch.equal(v, model.transformer.h[2].attn.state_dict()[k]) for k, v in untouched.items())


def fake_scores(block, group=1):
    heads = tuple(range(len(block)))
    diag = torch.tensor([block[i][i] for i in heads], dtype=torch.float32)
    return ph.HeadScores(
        "fisher",
        8,
        {"l.0": diag},
        {"l.0": heads},
        {"l.0": group},
        {"l.0": len(heads)},
        meta={"fisher_blocks": {"l.0": block}},
    )


def test_rearrangement_accounts_for_interactions():
    # heads 0 and 1 are each cheap to remove but redundant together (positive off-diagonal)
    block = [[1.0, 5.0, 0.0, 0.0], [5.0, 1.0, 0.0, 0.0], [0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 3.0]]
    scores = fake_scores(block)
    assert ph.select_heads(scores, num_heads=2) == {"l.0": [0, 1]}  # diagonal ranking
    assert plan_with_interactions(scores, num_heads=2) == {"l.0": [0, 2]}  # 1 + 2 < 1 + 1 + 10


def test_rearrangement_allocates_across_layers_and_keeps_groups():
    scores = ph.HeadScores(
        "fisher",
        8,
        {"a": torch.ones(4), "b": torch.ones(4)},
        {"a": (0, 1, 2, 3), "b": (0, 1, 2, 3)},
        {"a": 2, "b": 1},
        {"a": 4, "b": 4},
        meta={
            "fisher_blocks": {
                "a": torch.diag(torch.tensor([9.0, 9.0, 0.1, 0.1])).tolist(),
                "b": torch.diag(torch.tensor([0.5, 0.2, 7.0, 7.0])).tolist(),
            }
        },
    )
    assert plan_with_interactions(scores, num_heads=4) == {"a": [2, 3], "b": [0, 1]}
    with pytest.raises(ph.PlanError, match=r"cannot remove exactly 6 heads: .* 5 heads \(sparsity 0.6250\)"):
        plan_with_interactions(scores, num_heads=6)
    with pytest.raises(ph.PlanError, match="needs scores from method='fisher'"):
        plan_with_interactions(ph.HeadScores("gradient", 1, {}, {}, {}, {}), num_heads=1)


def test_real_scoring_carries_fisher_blocks():
    model = tm.build("bert")
    batches = [dict(b, labels=torch.tensor([0, 1, 1, 0])) for b in calibration()]
    scores = ph.score_heads(model, batches, method="fisher", progress=False)
    block = torch.tensor(scores.meta["fisher_blocks"]["bert.encoder.layer.0.attention"])
    torch.testing.assert_close(block.diagonal().float(), scores.scores["bert.encoder.layer.0.attention"])
    plan = plan_with_interactions(scores, sparsity=0.5)
    assert sum(len(h) for h in plan.values()) == 6


def _kl(model, reference, batches):
    total = 0.0
    with torch.no_grad():
        for b in batches:
            p = torch.log_softmax(reference(**b).logits, -1)
            q = torch.log_softmax(model(**b).logits, -1)
            total += float((p.exp() * (p - q)).sum(-1).mean())
    return total


def test_gate_tuning_lowers_the_divergence_and_folds_exactly():
    reference = tm.build("bert")
    model = copy.deepcopy(reference)
    ph.prune(model, {0: [0, 1], 1: [2], 2: [1, 2, 3]})
    gated = copy.deepcopy(model)
    batches = calibration()
    before = _kl(model, reference, batches)
    scales = ph.tune_gates(model, reference, batches, epochs=5, lr=0.05, average=0.0)  # the last step
    assert _kl(model, reference, batches) < before
    assert [len(v) for v in scales.values()] == [2, 3, 1]
    inputs = tm.make_inputs("bert", seed=9)
    with ph.head_gates(gated) as gates, torch.no_grad():
        for i, values in enumerate(scales.values()):
            gates[i].copy_(torch.tensor(values))
        expected = gated(**inputs).logits
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, expected, rtol=0, atol=1e-5)
    assert all(p.requires_grad for p in model.parameters())  # parameters were frozen only while tuning


def test_bias_tuning_moves_only_output_biases_and_lowers_the_divergence():
    reference = tm.build("bert")
    model = copy.deepcopy(reference)
    ph.prune(model, {0: [0, 1], 1: [2], 2: [1, 2, 3]})
    batches = calibration()
    with_bias = copy.deepcopy(model)
    ph.tune_gates(with_bias, reference, batches, epochs=5, lr=0.0, bias_lr=0.001)  # the biases alone
    assert _kl(with_bias, reference, batches) < _kl(model, reference, batches) / 2
    outputs = {l.name + "." + l.spec.o + ".bias" for l in ph.find_attention(model)}
    before, after = dict(model.named_parameters()), dict(with_bias.named_parameters())
    moved = {n for n in before if n.endswith("bias") and not torch.equal(before[n], after[n])}
    assert moved == outputs and all(p.grad is None for p in with_bias.parameters())
    llama = tm.build("llama")  # no output bias: nothing to tune there, and none is added
    ph.prune(llama, {0: [0, 1]})
    ph.tune_gates(llama, tm.build("llama"), [tm.make_inputs("llama")], epochs=1, bias_lr=0.01)
    assert all(l.module.o_proj.bias is None for l in ph.find_attention(llama))


def _moments(model, batches, gram=True):
    """The Recorder's statistics over the batches, as scoring records them."""
    from prune_heads.scoring.objective import Objective
    from prune_heads.scoring.recording import record

    return record(model, [{k: v for k, v in b.items() if k != "labels"} for b in batches], Objective(model), gram)


def _output_error(model, reference, index, batches) -> float:
    return float(((layer_outputs(model, index, batches) - layer_outputs(reference, index, batches)) ** 2).sum())


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_refit_beats_bias_compensation_on_held_out_tokens_and_folds_exactly(name):
    from prune_heads.recovery.gated import GatedModel
    from prune_heads.recovery.reconstruction import refit

    reference = tm.build(name)
    calib, held = calibration(name, 6), [tm.make_inputs(name, batch=4, seq=9, seed=100 + s) for s in range(3)]
    stats, held_stats = _moments(reference, calib), _moments(reference, held)
    layers = ph.find_attention(reference)
    plan = {layers[0].name: [0, 1] if name == "llama" else [1, 3]}  # llama: one whole KV group
    fitted = refit(layers[0], plan[layers[0].name], stats.moments[0], held_stats.moments[0])
    limit = refit(layers[0], plan[layers[0].name], stats.moments[0], held_stats.moments[0], bias=True)
    assert fitted.fallback is None and fitted.error <= limit.error
    errors = {}
    for kind, refits in (("fitted", {layers[0].name: fitted}), ("bias compensation", None)):
        model = copy.deepcopy(reference)
        gated = GatedModel(model, ph.find_attention(model))
        with gated:
            biases = None if refits else gated.compensation(plan, stats.means())
            gated.use(plan, biases, refits)
            with torch.no_grad():
                expected = [tm.main_output(gated(b)) for b in held]
        gated.fold(plan)
        with torch.no_grad():  # the folded, pruned model is the gated state that was measured
            for b, e in zip(held, expected):
                torch.testing.assert_close(tm.main_output(model(**b)), e, rtol=0, atol=1e-5)
        errors[kind] = _output_error(model, reference, 0, held)
    assert errors["fitted"] < errors["bias compensation"]


def test_each_ridge_s_fit_solves_its_damped_normal_equations_and_an_indefinite_system_gives_none():
    from prune_heads.recovery import reconstruction as R

    reference = tm.build("llama")
    stats = _moments(reference, calibration("llama", 6))
    held = _moments(reference, [tm.make_inputs("llama", batch=4, seq=9, seed=100)])
    fit = R._Fit.of(ph.find_attention(reference)[0], [0, 1], stats.moments[0], held.moments[0], True, None)
    kept = fit.gram[fit.columns][:, fit.columns]
    scale = float(fit.gram.diagonal()[fit.kept].mean())
    found = list(R._ridge_fits(fit, fit.gram, scale, R.RIDGES))
    assert [ridge for _, ridge, _ in found] == list(R.RIDGES)
    for error, ridge, theta in found:
        damping = 0.0 if math.isinf(ridge) else ridge * scale
        system = kept + damping * torch.eye(len(kept), dtype=torch.float64)
        right = fit.full @ fit.gram[:, fit.columns] + damping * fit.prior
        expected = fit.prior if math.isinf(ridge) else torch.linalg.solve(system, right.T).T  # LU, not Cholesky
        torch.testing.assert_close(theta, expected, rtol=1e-9, atol=1e-12)
        assert error == pytest.approx(fit.error(expected))
    assert R._damped_solve(-torch.eye(3, dtype=torch.float64), torch.ones(2, 3), torch.zeros(2, 3), 0.1) is None


def test_the_infinite_ridge_is_bias_compensation_and_no_bias_keeps_the_bias():
    from prune_heads.recovery import reconstruction

    reference = tm.build("llama")
    stats = _moments(reference, calibration("llama", 4))
    layer = ph.find_attention(reference)[0]
    model = copy.deepcopy(reference)
    gated = ph.recovery.gated.GatedModel(model, ph.find_attention(model))
    compensation = gated.compensation({layer.name: [2, 3]}, stats.means())[layer.name]
    held = _moments(reference, [tm.make_inputs("llama", batch=4, seq=9, seed=50)])
    original = reconstruction.RIDGES
    try:
        reconstruction.RIDGES = (float("inf"),)
        limit = reconstruction.refit(layer, [2, 3], stats.moments[0], held.moments[0])
    finally:
        reconstruction.RIDGES = original
    weight = ph.model.layers.output_projection(layer).matrix().detach()
    assert torch.equal(limit.weight, weight[:, :16])  # kept heads 0, 1: columns as they are, in the weights' dtype
    torch.testing.assert_close(limit.bias.float(), compensation, rtol=0, atol=1e-6)
    no_bias = reconstruction.refit(layer, [2, 3], stats.moments[0], held.moments[0], bias=False)
    assert torch.equal(no_bias.bias, torch.zeros(32, dtype=torch.float64))  # llama's o_proj has none
    emptied = reconstruction.refit(layer, [0, 1, 2, 3], stats.moments[0], held.moments[0])
    everything = gated.compensation({layer.name: [0, 1, 2, 3]}, stats.means())[layer.name]
    assert emptied.fallback is None and emptied.weight.numel() == 0  # no heads left: the mean output, said nowhere
    torch.testing.assert_close(emptied.bias.float(), everything, rtol=0, atol=1e-6)


def test_a_refit_that_cannot_be_trusted_falls_back_to_bias_compensation_and_says_why():
    from prune_heads.recovery.reconstruction import refit
    from prune_heads.scoring.recording import Moments

    layer = ph.find_attention(tm.build("llama"))[0]
    few = Moments(32, True)
    few.add(torch.randn(5, 32, generator=torch.Generator().manual_seed(0)))
    found = refit(layer, [0, 1], few, None)
    assert (
        found.fallback
        == "the fit has 17 unknowns per output and the calibration data gave 5 tokens; give at least 17 tokens"
        and found.ridge == float("inf")
    )
    silent = Moments(32, True)
    silent.add(torch.zeros(64, 32))  # the kept heads write nothing
    assert "carry no energy" in refit(layer, [0, 1], silent, None).fallback
    half = copy.deepcopy(layer.module).half()
    half_layer = ph.model.layers.describe(half, layer.spec, layer.name, 0)
    loud = Moments(32, True)
    loud.add(1e-4 * torch.randn(64, 32, generator=torch.Generator().manual_seed(1)))  # tiny features, huge fit
    found = refit(half_layer, [0, 1], loud, loud)
    assert torch.isfinite(found.weight.half()).all() and torch.isfinite(found.bias.half()).all()


def test_a_refused_fold_puts_the_refitted_projections_back():
    from prune_heads.recovery.gated import GatedModel
    from prune_heads.recovery.reconstruction import refit

    model = tm.build("llama")
    stats = _moments(model, calibration("llama", 4))
    layers = ph.find_attention(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gated = GatedModel(model, layers)
    plan = {layers[0].name: [0, 1]}
    with gated:
        gated.use(plan, None, {layers[0].name: refit(layers[0], [0, 1], stats.moments[0], None)})
    assert not torch.equal(
        model.state_dict()["model.layers.0.self_attn.o_proj.weight"], before["model.layers.0.self_attn.o_proj.weight"]
    )
    with pytest.raises(ph.PlanError):
        gated.fold({layers[0].name: [0]})  # half a KV group: refused
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_projection_updates_with_gates_and_biases_fold_exactly(name):
    from prune_heads.recovery.gated import GatedModel

    model = tm.build(name)
    layers = ph.find_attention(model)
    plan = {layers[0].name: [0, 1]}  # llama: one whole KV group
    held = [tm.make_inputs(name, batch=2, seq=7, seed=s) for s in range(2)]
    generator = torch.Generator().manual_seed(0)
    gated = GatedModel(model, layers)
    with gated, torch.no_grad():
        gated.use(plan)
        plain = [tm.main_output(gated(b)) for b in held]
        updates = gated.add_updates(rank=3, seed=0)
        assert len(updates) == 2 * len(layers) and all(t.requires_grad for t in updates)
        assert all(torch.equal(a, b) for a, b in zip(plain, (tm.main_output(gated(b)) for b in held)))  # up is 0
        for _, up in gated.updates:
            up.copy_(torch.randn(up.shape, generator=generator))
        for scale, bias in zip(gated.scales, gated.biases):
            scale.copy_(1 + torch.rand(scale.shape, generator=generator))
            bias.copy_(torch.randn(bias.shape, generator=generator))
        expected = [tm.main_output(gated(b)) for b in held]
    assert not any(torch.allclose(e, p) for e, p in zip(expected, plain))
    gated.fold(plan)
    with torch.no_grad():  # the pruned model computes without hooks what the gated one measured
        for b, e in zip(held, expected):
            torch.testing.assert_close(tm.main_output(model(**b)), e, rtol=1e-5, atol=1e-4)


def _tuning_gradients(name: str, dtype: torch.dtype, plain: bool) -> tuple[list[torch.Tensor], set[int], set[int]]:
    """One backward pass of the gated model with gates, biases and projection updates all tuned: the
    gradients, the storages autograd saved, and those of the gated features the output projections took
    (with `plain`, the update's first step as the plain product, which autograd gives its own backward)."""
    from prune_heads.model.layers import resolve
    from prune_heads.recovery import gated as module

    model = tm.build(name).to(dtype)
    layers = ph.find_attention(model)
    batch = tm.make_inputs(name, batch=2, seq=7, seed=3)
    gated = module.GatedModel(model, layers)
    saved: set[int] = set()
    alive: list[torch.Tensor] = []  # held, so that no later tensor reuses their storage

    def keep(tensor):
        saved.add(tensor.untyped_storage().data_ptr())
        return tensor

    original = module._GatedDown.apply
    if plain:
        module._GatedDown.apply = lambda gated_input, down, *rest: gated_input @ down.t()
    try:
        with ph.scoring.objective.frozen(model), gated:
            gated.use({layers[0].name: [0, 1]})
            updates = gated.add_updates(rank=3, seed=0)
            with torch.no_grad():
                for _, up in gated.updates:
                    up.copy_(torch.randn(up.shape, generator=torch.Generator().manual_seed(1)))
            params = [s.requires_grad_() for s in gated.scales] + [b.requires_grad_() for b in gated.biases] + updates
            with (
                ph.model.hooks.hooks(
                    (resolve(l.module, l.spec.o), "forward", lambda m, a, o: alive.append(a[0])) for l in layers
                ),
                torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t),
            ):
                loss = tm.main_output(gated(batch)).float().square().mean()
            loss.backward()
    finally:
        module._GatedDown.apply = original
    return [p.grad for p in params], saved, {t.untyped_storage().data_ptr() for t in alive}


@pytest.mark.parametrize("name,dtype", [("llama", torch.float32), ("llama", torch.bfloat16), ("gpt2", torch.float32)])
def test_projection_updates_keep_no_gated_copy_and_give_the_plain_gradients_bit_for_bit(name, dtype):
    grads, saved, taken = _tuning_gradients(name, dtype, plain=False)
    expected, saved_plain, taken_plain = _tuning_gradients(name, dtype, plain=True)
    assert all(g is not None for g in grads) and all(torch.equal(g, e) for g, e in zip(grads, expected))
    assert taken_plain & saved_plain  # the plain product keeps every layer's gated features for its backward
    assert not taken & saved  # the update's own backward makes them again from what the gate keeps


def test_a_refit_is_swapped_with_the_columns_it_replaces_and_back():
    from prune_heads.recovery.gated import GatedModel
    from prune_heads.recovery.reconstruction import refit

    model = tm.build("llama")
    stats = _moments(model, calibration("llama", 4))
    layers = ph.find_attention(model)
    weight = ph.model.layers.output_projection(layers[0]).matrix()
    original = weight.detach().clone()
    fitted = refit(layers[0], [0, 1], stats.moments[0], None)
    fit = fitted.weight.clone()
    gated = GatedModel(model, layers)
    with gated:
        gated.use({layers[0].name: [0, 1]}, None, {layers[0].name: fitted})
        assert torch.equal(weight[:, 16:], fit) and torch.equal(fitted.weight, original[:, 16:])  # no third copy
        gated.restore()
    assert torch.equal(weight, original) and torch.equal(fitted.weight, fit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_update_backward_sums_as_the_plain_product_at_a_real_model_size(dtype):
    """At SmolLM2's width and a batch of 8 x 256 tokens the gradient of `down` sums over 2,048 tokens: only the
    same products as autograd's (gradᵀ x, not (xᵀ grad)ᵀ) give the same bits."""
    from prune_heads.model.gates import gated_features
    from prune_heads.recovery.gated import _GatedDown

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 256, 576, generator=generator).to(dtype)
    gate = (torch.rand(9, generator=generator) + 0.5).requires_grad_()
    down = (torch.randn(16, 576, generator=generator) / 24).requires_grad_()
    up, weight = torch.randn(576, 16, generator=generator), torch.randn(576, 576, generator=generator).to(dtype)

    def gradients(start):
        gated = gated_features(x, gate, 64)
        out = gated @ weight.t() + start(gated, down.to(dtype)) @ up.to(dtype).t()
        return torch.autograd.grad(out.float().square().mean(), [gate, down])

    ours = gradients(lambda gated, d: _GatedDown.apply(gated, d, x, gate, 64))
    plain = gradients(lambda gated, d: gated @ d.t())
    assert all(torch.equal(a, b) for a, b in zip(ours, plain))


def test_the_removal_cost_is_what_refitting_the_kept_columns_and_bias_cannot_recover():
    """Structured OBS from the inverse's side (Cholesky factors) equals the best least-squares fit from the kept
    side on the same damped Gram matrix (the Schur complement), relative to the unpruned output's energy; its
    work counts the layer's one inverse and each cost's solve."""
    from prune_heads.recovery.reconstruction import DAMPING, RemovalCost
    from prune_heads.scoring.recording import Moments

    layer = ph.find_attention(tm.build("llama"))[0]
    width, d = layer.num_heads * layer.head_dim, layer.head_dim
    moments = Moments(width, True)
    moments.add(torch.randn(200, width, generator=torch.Generator().manual_seed(0)) + 0.3)
    cost = RemovalCost([layer], [moments])
    weight = output_projection(layer).matrix().detach().double()
    full = torch.cat([weight, torch.zeros(weight.shape[0], 1, dtype=torch.float64)], 1)  # Llama: no bias
    gram = moments.matrix()
    damped = gram.clone()
    damped.diagonal()[:width] += DAMPING * gram.diagonal()[:width].mean()
    for removed in [(0,), (1, 3), (0, 1, 2)]:
        kept = [h * d + i for h in range(layer.num_heads) if h not in removed for i in range(d)] + [width]
        across = full @ damped[:, kept]
        recovered = torch.trace(across @ torch.linalg.solve(damped[kept][:, kept], across.T))
        expected = (torch.trace(full @ damped @ full.T) - recovered) / (full @ gram * full).sum()
        assert cost(layer.name, removed) == pytest.approx(float(expected), rel=1e-8)
    solves = sum((len(r) * d) ** 3 / 3 + weight.shape[0] * (len(r) * d) ** 2 for r in [(0,), (1, 3), (0, 1, 2)])
    assert cost.flops == pytest.approx(4 / 3 * (width + 1) ** 3 + solves)


def test_a_matrix_short_of_positive_definite_is_inverted_as_the_pseudo_inverse():
    from prune_heads.recovery.reconstruction import _spd_inverse, _whitened

    singular = torch.diag(torch.tensor([2.0, 0.0, 4.0], dtype=torch.float64))
    singular[0, 2] = singular[2, 0] = 1.0
    pseudo = torch.linalg.pinv(singular, hermitian=True)
    torch.testing.assert_close(_spd_inverse(singular), pseudo)
    right = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    solved = _whitened(singular, right)
    torch.testing.assert_close(solved.T @ solved, right.T @ pseudo @ right)
    definite = singular + torch.eye(3, dtype=torch.float64)
    torch.testing.assert_close(
        _whitened(definite, right).square().sum(), torch.trace(right.T @ definite.inverse() @ right)
    )
