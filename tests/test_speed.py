import copy

import pytest
import tiny_models as tm
import torch

import prune_heads as ph
from prune_heads.evaluation.speed import PeakAllocations, benchmark, benchmark_pair
from prune_heads.model.inputs import dummy_inputs
from prune_heads.runtime.work import count_flops


def test_flops_drop_by_exactly_the_removed_heads():
    model = tm.build("bert")  # hidden 32, head_dim 8
    inputs = dummy_inputs(model, batch_size=2, seq_len=10)
    before = count_flops(model, inputs)
    ph.prune(model, {0: [0, 1], 2: [3]})
    after = count_flops(model, inputs)
    b, s, hidden, d = 2, 10, 32, 8
    per_head = 4 * 2 * b * s * hidden * d + 2 * 2 * b * s * s * d  # q, k, v, o projections + scores + context
    assert before - after == 3 * per_head


def test_fused_attention_counts_as_its_products_whatever_the_kernel():
    # sdpa with grouped-query key and value heads (the CPU's flash kernel, which torch's counter skips, and
    # CUDA's kernels, whose older counters refuse fewer key/value heads) counts what eager attention does
    inputs = tm.make_inputs("llama")
    eager, sdpa = tm.build("llama"), tm.build("llama", attn="sdpa")
    assert sdpa.config.num_key_value_heads < sdpa.config.num_attention_heads
    assert count_flops(sdpa, inputs) == count_flops(eager, inputs)


def test_peak_allocations_count_live_tensors_once_and_print_nothing(capfd):
    x = torch.randn(1000, 1000)  # 4 MB, made before: not counted

    def forward(x):
        a = x @ x  # 4 MB
        b = a.exp()  # 4 MB
        del a
        c = b.t().contiguous()  # 4 MB, b's 4 MB still alive; the view b.t() adds nothing
        x.add_(0)  # in place: nothing new
        return c.sum()  # 4 bytes more, with b and c alive: the peak

    with PeakAllocations() as allocations:
        forward(x)
    assert allocations.peak == 8_000_004 and allocations.current == 0
    assert capfd.readouterr().err == ""  # the torch profiler's kineto printed USDT lines here


def test_benchmark_reports_settings_and_decoder_figures():
    model = tm.build("llama")
    result = benchmark(model, batch_size=2, seq_len=12, repeats=3, warmup=1, generate_tokens=4)
    assert result["settings"] == {
        "batch_size": 2,
        "seq_len": 12,
        "device": "cpu",
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "repeats": 3,
        "warmup": 1,
    }
    assert result["latency_p90_ms"] >= result["latency_ms"] > 0
    assert result["tokens_per_s"] == pytest.approx(result["examples_per_s"] * 12)
    assert result["parameters"] == sum(p.numel() for p in model.parameters())
    assert result["peak_memory_bytes"] > result["parameters"] * 4
    assert result["generate_tokens_per_s"] > 0 and result["kv_cache_bytes"] > 0
    rows, length, d, kv, inner, vocab = 2, 12, 32, 16, 64, 128  # two of four heads' keys and values: 16 wide
    layer = 2 * 2 * length * d * d + 2 * 2 * length * d * kv + 2 * 2 * length * length * d + 3 * 2 * length * d * inner
    assert result["flops"] == rows * (3 * layer + 2 * length * d * vocab)  # q o, k v, attention, MLP; the head


def test_a_thread_count_asked_for_is_set_while_timing_and_given_back():
    before = torch.get_num_threads()
    asked = 1 if before > 1 else 2
    result = benchmark(tm.build("bert"), batch_size=1, seq_len=8, repeats=1, warmup=0, threads=asked)
    assert result["settings"]["threads"] == asked and torch.get_num_threads() == before


def test_pair_benchmark_shows_smaller_kv_cache_after_removing_groups():
    original = tm.build("llama")
    pruned = tm.build("llama")
    ph.prune(pruned, {i: [0, 1] for i in range(3)})  # one of two KV groups in every layer
    before, after = benchmark_pair(
        original, pruned, batch_size=2, seq_len=8, repeats=2, warmup=1, generate_tokens=3, generate_batch_sizes=[1, 4]
    )
    assert after["kv_cache_bytes"] * 2 == before["kv_cache_bytes"]
    assert [g["batch_size"] for g in after["generation"]] == [1, 4]
    for b, a in zip(before["generation"], after["generation"]):  # the cache shrinks in proportion at every batch
        assert a["kv_cache_bytes"] * 2 == b["kv_cache_bytes"] and a["generate_tokens_per_s"] > 0
    assert before["generation"][1]["kv_cache_bytes"] == 4 * before["generation"][0]["kv_cache_bytes"]
    assert after["flops"] < before["flops"] and after["parameters"] < before["parameters"]


def test_dummy_inputs_fit_vision_and_speech_models():
    for name in ("whisper", "t5"):
        model = tm.build(name)
        assert benchmark(model, batch_size=1, seq_len=6, repeats=1, warmup=0)["flops"] > 0  # the inputs fit
    vit = tm.build("vit")  # a 16-pixel image in 4-pixel patches: 16 patches and the class token
    tokens, d, inner, patch = 17, 32, 64, 3 * 4 * 4
    layer = 4 * 2 * tokens * d * d + 2 * 2 * tokens * tokens * d + 2 * 2 * tokens * d * inner  # q k v o, attention, MLP
    by_hand = 2 * 16 * patch * d + 3 * layer + 2 * d * vit.config.num_labels  # patches in, 3 layers, the classifier
    assert benchmark(vit, batch_size=1, seq_len=6, repeats=1, warmup=0)["flops"] == by_hand


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_heads_for_flops_meets_the_target_with_the_fewest_heads(name):
    model = tm.build(name)
    inputs = dummy_inputs(model, 1, 16)
    total = count_flops(model, inputs)
    n = ph.heads_for_flops(model, 0.9, seq_len=16)
    layers = ph.find_attention(model)
    order = [(l.index, h) for h in range(4) for l in layers]  # spread over layers: every head costs the same

    def flops_without(k):
        pruned = copy.deepcopy(model)
        plan = {}
        for layer, head in order[:k]:
            plan.setdefault(layer, []).append(head)
        return count_flops(ph.prune(pruned, plan), inputs)

    assert 0 < n < 12 and flops_without(n) <= 0.9 * total < flops_without(n - 1)
    with pytest.raises(ph.PlanError, match="removing all 12 heads keeps"):
        ph.heads_for_flops(model, 0.1, seq_len=16)
