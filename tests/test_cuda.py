"""On a CUDA GPU (skipped where there is none): scoring, the written text, the whole flow, removal and reloading
give on the GPU what they give on the CPU, and a bfloat16 model stays on the GPU in bfloat16 through every step."""

import copy

import pytest
import tiny_models as tm
import torch

import prune_heads as ph
from prune_heads.config import SHARE
from prune_heads.recovery.generated import with_generated

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    """TF32 would round float32 products to 10 bits of mantissa: the comparisons with the CPU need full float32."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def on_gpu(batch: list[dict]) -> list[dict]:
    return [{k: v.to(CUDA) for k, v in b.items()} for b in batch]


def unlabelled_batches(device) -> list[dict[str, torch.Tensor]]:
    """The tiny Llama's batches on `device`, without labels (the recordings read inputs only)."""
    return [{k: v.to(device) for k, v in b.items() if k != "labels"} for b in tm.batches("llama")]


@pytest.mark.parametrize("name", ["bert", "llama", "gpt2", "t5"])
@pytest.mark.parametrize("method", ["gradient", "fisher"])
def test_scores_on_the_gpu_equal_the_cpu(name, method):
    cpu = ph.score_heads(tm.build(name), tm.batches(name), method=method, progress=False)
    gpu = ph.score_heads(tm.build(name).to(CUDA), tm.batches(name), method=method, progress=False)
    assert gpu.heads == cpu.heads
    for layer, scores in cpu.scores.items():
        assert gpu.scores[layer].device.type == "cpu"  # scores come back to the CPU whatever the model's device
        torch.testing.assert_close(gpu.scores[layer], scores, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("name", ["bert", "llama", "gpt2"])
def test_zero_gates_equal_removal_on_the_gpu(name):
    model, inputs = tm.build(name).to(CUDA), on_gpu([tm.make_inputs(name)])[0]
    layers = ph.find_attention(model)
    plan = tm.uneven_plan(layers)
    with ph.head_gates(model) as gates, torch.no_grad():
        tm.gate_off(gates, layers, plan)
        gated = tm.main_output(model(**inputs))
    ph.prune(model, plan)
    with torch.no_grad():
        pruned = tm.main_output(model(**inputs))
    torch.testing.assert_close(pruned, gated, rtol=0, atol=1e-5)
    assert all(p.device.type == "cuda" for p in model.parameters())


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_prune_model_on_the_gpu_equals_the_cpu(name):
    config = ph.PruneConfig(selection=ph.SelectionConfig(num_heads=4))
    cpu, gpu = tm.build(name), tm.build(name).to(CUDA)
    on_cpu = ph.prune_model(cpu, tm.batches(name), config, progress=False)
    on_gpu_ = ph.prune_model(gpu, tm.batches(name), config, progress=False)
    assert on_gpu_.plan == on_cpu.plan
    assert [e.get("kept") for e in on_gpu_.recovery] == [e.get("kept") for e in on_cpu.recovery]
    assert on_gpu_.work.as_dict() == pytest.approx(
        on_cpu.work.as_dict()
    )  # counted work, not the device, limits the flow
    assert all(p.device.type == "cuda" for p in gpu.parameters())
    inputs = tm.make_inputs(name)
    with torch.no_grad():
        expected = tm.main_output(cpu(**inputs))
        found = tm.main_output(gpu(**on_gpu([inputs])[0])).cpu()
    torch.testing.assert_close(found, expected, rtol=1e-3, atol=1e-4)


def test_the_text_a_model_writes_on_the_gpu_is_the_cpus():
    given = tm.batches("llama", n=3, batch=8)
    cpu = with_generated(tm.build("llama"), given, SHARE, seed=0)[1]
    gpu = with_generated(tm.build("llama").to(CUDA), on_gpu(given), SHARE, seed=0)[1]
    assert all(torch.equal(a["input_ids"], b["input_ids"].cpu()) for a, b in zip(cpu, gpu, strict=True))


def test_bfloat16_on_the_gpu_prunes_saves_reloads_and_generates(tmp_path):
    model = tm.build("llama", dtype=torch.bfloat16).to(CUDA)
    result = ph.prune_model(model, on_gpu(tm.batches("llama")), ph.PruneConfig(), progress=False)
    assert result.heads_removed > 0
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    inputs = on_gpu([tm.make_inputs("llama")])[0]
    ph.save_pruned(model, tmp_path / "pruned")
    reloaded = ph.load_pruned(tmp_path / "pruned", dtype=torch.bfloat16, attn_implementation="eager").to(CUDA).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=0)
    generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    again = reloaded.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert generated.shape == (2, inputs["input_ids"].shape[1] + 4) and torch.equal(generated, again)


def test_bfloat16_sdpa_with_grouped_key_value_heads_prunes_on_the_gpu():
    # unpadded batches: CUDA's fused attention then takes the grouped key and value heads unexpanded, which
    # torch's FLOP counter (before 2.13) refused, so the default path failed counting its work
    model = tm.build("llama", dtype=torch.bfloat16, attn="sdpa").to(CUDA)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    data = [dict(b, attention_mask=torch.ones_like(b["attention_mask"])) for b in on_gpu(tm.batches("llama"))]
    result = ph.prune_model(model, data, ph.PruneConfig(), progress=False)
    assert result.heads_removed > 0 and result.work.calibration_pass > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_scoring_leaves_the_model_where_it_was():
    model = tm.build("llama").to(CUDA)
    before = copy.deepcopy(model.state_dict())
    ph.score_heads(model, tm.batches("llama"), method="fisher", progress=False)
    after = model.state_dict()
    assert all(after[k].device.type == "cuda" and torch.equal(after[k], v) for k, v in before.items())


def test_the_statistics_algebra_runs_on_the_gpu_and_gives_the_cpus_results():
    from prune_heads.recovery.reconstruction import RemovalCost, refit
    from prune_heads.scoring.objective import Objective
    from prune_heads.scoring.recording import record

    found = {}
    for device in ("cpu", CUDA):
        model = tm.build("llama").to(device)
        batches = unlabelled_batches(device)
        moments = record(model, batches, Objective(model), gram=True).moments
        layers = ph.find_attention(model)
        assert moments[0].matrix().device.type == torch.device(device).type  # solved where the tokens were
        fitted = refit(layers[0], [0, 1], moments[0], None)
        assert fitted.weight.device.type == "cpu"  # what the gated model swaps in, in CPU memory
        found[str(device)] = fitted, RemovalCost(layers, moments)(layers[0].name, (0, 1))
    (cpu_fit, cpu_cost), (gpu_fit, gpu_cost) = found.values()
    torch.testing.assert_close(gpu_fit.weight, cpu_fit.weight, rtol=1e-4, atol=1e-6)
    assert gpu_cost == pytest.approx(cpu_cost, rel=1e-4)


def test_kv_heads_are_shared_on_the_gpu_as_on_the_cpu():
    """Key maps, the shared refit and the proven shared layout, each computed where the model is, give on the
    GPU the CPU's fit and the CPU's model."""
    from prune_heads.model.kv_sharing import share_kv_heads
    from prune_heads.recovery.reconstruction import refit
    from prune_heads.recovery.sharing_statistics import merge_maps, reading, sharing_statistics

    merges = {1: 0}
    found = []
    for device in ("cpu", CUDA):
        model = tm.build("llama").to(device)
        batches = unlabelled_batches(device)
        layer = ph.find_attention(model)[0]
        calibration, heldout, maps = sharing_statistics(model, [layer], batches[:-1], batches[-1:])
        fitted = refit(layer, (), calibration[layer.name], heldout[layer.name], reads=reading(layer, merges))
        share_kv_heads(model, {0: merges}, {layer.name: merge_maps(maps[layer.name], layer, merges)})
        assert all(p.device.type == torch.device(device).type for p in model.parameters())
        with torch.no_grad():
            found.append((fitted, model(**batches[0]).logits.cpu()))
    (cpu_fit, cpu_logits), (gpu_fit, gpu_logits) = found
    torch.testing.assert_close(gpu_fit.weight, cpu_fit.weight, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gpu_logits, cpu_logits, rtol=1e-4, atol=1e-5)
