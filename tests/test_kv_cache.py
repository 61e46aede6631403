"""A KV-cache budget: its parsing, the cache's size against the one transformers fills, the fewest whole KV
groups that fit, and the refusals (before any data) that name the reachable sizes."""

import pytest
import tiny_models as tm
import torch
import transformers as T

import prune_heads as ph
from prune_heads.config import KvCacheBudget
from prune_heads.evaluation.speed import kv_cache_bytes
from prune_heads.recipes import RecipeError, parse_recipe
from prune_heads.scoring.kv_cache import heads_for_kv_cache

GROUP = 2 * 8 * 2  # a tiny Llama's KV group in f16: key and value, head size 8, two bytes, per token


def test_a_budget_reads_size_context_and_cache_type():
    assert KvCacheBudget.parse("120MiB@8192") == KvCacheBudget(120 * 2**20, 8192, "f16")
    assert KvCacheBudget.parse(" 1.5 GiB @ 32k : Q8_0") == KvCacheBudget(3 * 2**29, 32768, "q8_0")
    assert KvCacheBudget.parse("96000KB@100:q4_0") == KvCacheBudget(96_000_000, 100, "q4_0")
    for bad in ("120MiB", "120@8192", "120MiB@8192:q3_k", "0MiB@8192", "1MiB@0", "lots"):
        with pytest.raises(ph.PlanError, match=r"SIZE@TOKENS\[:TYPE\]|above 0"):
            KvCacheBudget.parse(bad)
    with pytest.raises(ph.PlanError, match="SIZE@TOKENS"):
        ph.SelectionConfig(kv_cache="120MB")


def gemma3(layers: int) -> torch.nn.Module:
    """A Gemma 3 whose layers 1 to 5 of every six slide over 4 tokens (layer 6 attends to all)."""
    torch.manual_seed(0)
    config = T.Gemma3TextConfig(**{**tm.COMMON, "num_hidden_layers": layers}, num_key_value_heads=2, head_dim=8)
    return T.Gemma3ForCausalLM(config.__class__(**{**config.to_dict(), "sliding_window": 4})).eval()


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma3"])
def test_the_size_is_what_transformers_caches(name):
    """Full attention: the bytes transformers' cache holds after 20 tokens in float32, before and after one KV
    group goes. A sliding layer holds its window: the 3 keys transformers keeps between steps and the new
    token's own."""
    model = tm.build(name) if name != "gemma3" else gemma3(6)
    for _ in ("unpruned", "pruned"):
        out = model(input_ids=torch.randint(3, 100, (1, 20)), use_cache=True)
        layers = ph.find_attention(model)
        sliding = sum(l.num_kv_heads for l in layers if getattr(l.module, "sliding_window", None))
        assert ph.kv_cache_size(model, 20, "f32") == kv_cache_bytes(out.past_key_values) + sliding * 2 * 8 * 4
        ph.prune(model, {0: list(layers[0].heads[: layers[0].group_size])})  # the first layer's first group


def test_the_fewest_whole_kv_groups_that_fit():
    model = tm.build("llama")  # 3 layers x 2 KV groups of 2 query heads
    full = 6 * GROUP * 100
    assert ph.kv_cache_size(model, 100) == full
    assert heads_for_kv_cache(model, KvCacheBudget(full - GROUP * 100, 100)) == 2  # exactly one group
    assert heads_for_kv_cache(model, KvCacheBudget(full - GROUP * 100 - 1, 100)) == 4  # one byte less: two
    assert heads_for_kv_cache(model, KvCacheBudget(1, 100), min_heads_per_layer=0) == 12
    assert heads_for_kv_cache(model, KvCacheBudget(full, 100, "f32")) == 6  # f32 doubles the bytes: half go


def test_what_cannot_fit_or_already_fits_is_refused_naming_the_sizes():
    model = tm.build("llama")
    with pytest.raises(ph.PlanError, match=r"removing the most the structure allows \(6 heads.*leaves 9.38 KiB"):
        heads_for_kv_cache(model, KvCacheBudget(GROUP * 100, 100))  # each layer keeps a group: 3 stay
    with pytest.raises(ph.PlanError, match="KV cache is 18.75 KiB at 100 tokens \\(f16\\), already within"):
        heads_for_kv_cache(model, KvCacheBudget(2**20, 100))
    with pytest.raises(ph.PlanError, match="head size 8 does not split into q8_0's blocks of 32"):
        heads_for_kv_cache(model, KvCacheBudget(GROUP, 100, "q8_0"))
    with pytest.raises(ph.PlanError, match="removes query heads only"):
        heads_for_kv_cache(model, KvCacheBudget(GROUP, 100), gqa="even")
    with pytest.raises(ph.PlanError, match="decoder-only language models"):
        heads_for_kv_cache(tm.build("bert"), KvCacheBudget(GROUP, 100))


def test_layers_that_cache_different_sizes_need_every_layer_alike():
    """Five sliding layers hold 4 tokens, the sixth all 100: which groups go decides the size, unless every
    layer loses the same."""
    model = gemma3(6)
    full = ph.kv_cache_size(model, 100)
    assert full == 2 * GROUP * (5 * 4 + 100)
    with pytest.raises(ph.PlanError, match="cache different sizes.*--uniform"):
        heads_for_kv_cache(model, KvCacheBudget(full - 1, 100))
    assert heads_for_kv_cache(model, KvCacheBudget(full - 1, 100), uniform=True) == 12  # a group from each layer


def test_prune_model_meets_the_budget_and_recipes_take_it():
    model = tm.build("llama")
    batches = [tm.make_inputs("llama", batch=4, seed=s) for s in range(2)]
    data = ph.TaskData("causal-lm", [{**b, "labels": b["input_ids"]} for b in batches], 8)
    limit = 6 * GROUP * 100 - 2 * GROUP * 100
    config = ph.PruneConfig(selection=ph.SelectionConfig(kv_cache=f"{limit}B@100"), recovery=ph.RecoveryConfig.off())
    found = ph.prune_model(model, data, config, progress=False)
    assert found.heads_removed == 4 and ph.kv_cache_size(model, 100) == limit
    base = {"model": "m", "data": {"source": "d"}, "task": "causal-lm"}
    assert parse_recipe({**base, "selection": {"kv_cache": "1MiB@8192"}}).selection.kv_cache == "1MiB@8192"
    with pytest.raises(RecipeError, match="selection.kv_cache needs scoring.steps 1"):
        parse_recipe({**base, "selection": {"kv_cache": "1MiB@8192"}, "scoring": {"steps": 2}})
