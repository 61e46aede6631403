"""Shared KV heads (prune_heads.model.kv_sharing): the shared layer computes what the hooks compute on the
unchanged model, a KV head whose keys are a rotary-commuting scale of another's is shared without changing the
model, save -> load and generate() keep it, and what cannot share is refused before anything changes. Their
refits (prune_heads.recovery.sharing_statistics): solved from one recording of every turn, with the shared
layer's own error."""

import json
from collections.abc import Callable

import pytest
import tiny_models as tm
import torch
import transformers as T

import prune_heads as ph
from prune_heads.model.kv_sharing import fit_key_maps, maps_keys, share_kv_heads, shared_kv
from prune_heads.model.layers import find_attention
from prune_heads.model.surgery import RECORD_KEY, PlanError, RecordError, record_digest
from prune_heads.recovery.reconstruction import refit
from prune_heads.recovery.sharing_statistics import (
    SharedStatistics,
    key_products,
    kv_merges,
    merge_maps,
    reading,
    repointed,
    sharing_statistics,
)

CONFIGS = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),  # biases on q, k, v
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"head_dim": 8}),  # a norm of each head's q and k
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {}),
}
# layer 0 halves its KV heads, layer 1 keeps them, layer 2 goes to one
SHARING = {0: {1: 0, 3: 2}, 2: {0: 3, 1: 3, 2: 3}}


def eight_over_four(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny decoder of the family with 8 query heads over 4 KV heads in each of its 3 layers."""
    config_class, model_class, extra = CONFIGS[name]
    config = config_class(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return model_class(config).eval()


def batch(seed: int = 1, rows: int = 2, tokens: int = 12) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 128, (rows, tokens), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding, as generation uses
    return {"input_ids": ids, "attention_mask": mask}


def random_maps(model, sharing, seed: int = 0) -> dict[str, dict[int, torch.Tensor]]:
    """A complex scale per rotary pair for each merged KV head of the layers whose keys can be mapped."""
    generator = torch.Generator().manual_seed(seed)
    layers = find_attention(model)
    maps = {}
    for index, merges in sharing.items():
        layer = layers[index]
        if maps_keys(layer):
            pairs = layer.head_dim // 2
            maps[layer.name] = {
                j: torch.complex(torch.randn(pairs, generator=generator), torch.randn(pairs, generator=generator)).to(
                    torch.complex128
                )
                for j in merges
            }
    return maps


def logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_shared_layout_computes_what_the_hooks_do_and_saves_and_loads(tmp_path, name):
    model = eight_over_four(name)
    layers = find_attention(model)
    maps = random_maps(model, SHARING)
    assert bool(maps) == (name != "qwen3")  # Qwen3 normalises each head's keys: they are shared as they are
    inputs = batch()
    with shared_kv(layers, {layers[i].name: m for i, m in SHARING.items()}, maps):
        expected = logits(model, inputs)
    share_kv_heads(model, SHARING, maps)
    after = find_attention(model)
    assert [(l.num_heads, l.num_kv_heads) for l in after] == [(8, 2), (8, 4), (8, 1)]
    assert after[0].heads == (0, 1, 2, 3, 4, 5, 6, 7) and after[0].kv_heads == (0, 2)
    assert after[2].heads == (0, 1, 2, 3, 4, 5, 6, 7) and after[2].kv_heads == (3,)
    got = logits(model, inputs)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * expected.abs().max().item())
    ph.save_pruned(model, tmp_path / "shared")
    loaded = ph.load_pruned(tmp_path / "shared", attn_implementation="eager").eval()
    torch.testing.assert_close(logits(loaded, inputs), got, rtol=0, atol=0)
    prompt = {k: v[1:] for k, v in inputs.items()}
    generated = model.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(loaded.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=0), generated)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 6


def test_query_heads_are_laid_out_by_the_kv_head_they_attend_to_in_a_stock_config(tmp_path):
    """Merging KV head 0 into 3 and 1 into 2 moves heads 0, 1 next to 6, 7 and 2, 3 next to 4, 5: each KV head's
    query heads contiguous, as repeat_kv reads them. Every layer the same: a stock config loads it."""
    model = eight_over_four("llama")
    sharing = {i: {0: 3, 1: 2} for i in range(3)}
    inputs = batch()
    layers = find_attention(model)
    with shared_kv(layers, {l.name: sharing[0] for l in layers}, {}):
        expected = logits(model, inputs)
    share_kv_heads(model, sharing)
    layer = find_attention(model)[0]
    assert layer.heads == (2, 3, 4, 5, 0, 1, 6, 7) and layer.kv_heads == (2, 3)
    torch.testing.assert_close(logits(model, inputs), expected, rtol=0, atol=1e-4 * expected.abs().max().item())
    ph.save_pruned(model, tmp_path / "stock")
    config = json.loads((tmp_path / "stock" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and RECORD_KEY not in config
    stock = T.AutoModelForCausalLM.from_pretrained(tmp_path / "stock", attn_implementation="eager").eval()
    torch.testing.assert_close(logits(stock, inputs), logits(model, inputs), rtol=0, atol=0)


def test_kv_heads_whose_keys_are_a_rotary_scale_of_others_are_shared_without_changing_the_model():
    """KV head 1's key rows are a complex scale per rotary pair of KV head 0's (3's of 2's) and its value rows
    are KV head 0's (2's): the fitted maps are those scales, and sharing 1 into 0 and 3 into 2 with them leaves
    every output as it was."""
    model = eight_over_four("llama")
    layer = find_attention(model)[1]
    half = layer.head_dim // 2
    generator = torch.Generator().manual_seed(3)
    scales = {j: torch.complex(*torch.randn(2, half, generator=generator)).to(torch.complex128) for j in (1, 3)}
    tm.plant_scaled_kv_heads(layer, scales)
    batches = [batch(seed) for seed in range(3)]
    products = key_products(model, find_attention(model), batches)
    maps = fit_key_maps(products[layer.name], {1: 0, 3: 2}, layer.kv_heads)
    for j, scale in scales.items():
        torch.testing.assert_close(maps[j], scale, rtol=1e-4, atol=1e-4)
    before = logits(model, batches[0])
    share_kv_heads(model, {1: {1: 0, 3: 2}}, {layer.name: maps})
    assert find_attention(model)[1].num_kv_heads == 2
    torch.testing.assert_close(logits(model, batches[0]), before, rtol=0, atol=1e-4 * before.abs().max().item())


def test_sharing_and_removing_heads_compose_in_either_order(tmp_path):
    model = eight_over_four("llama")
    inputs = batch()
    ph.prune(model, {0: [6, 7]})  # KV head 3 goes with its query heads
    share_kv_heads(model, {0: {1: 0, 2: 0}, 1: {2: 0, 3: 1}})
    ph.prune(model, {1: [0, 2]})  # one query head that each KV head of layer 1 serves
    layers = find_attention(model)
    assert [(l.num_heads, l.num_kv_heads) for l in layers[:2]] == [(6, 1), (6, 2)]
    assert layers[0].heads == (0, 1, 2, 3, 4, 5) and layers[0].kv_heads == (0,)
    assert layers[1].heads == (1, 4, 5, 3, 6, 7) and layers[1].kv_heads == (0, 1)
    ph.save_pruned(model, tmp_path / "both")
    loaded = ph.load_pruned(tmp_path / "both", attn_implementation="eager").eval()
    torch.testing.assert_close(logits(loaded, inputs), logits(model, inputs), rtol=0, atol=0)


@pytest.mark.parametrize(
    "sharing, match",
    [
        ({0: {1: 0}}, r"can share \[1, 2\] KV heads"),
        ({0: {1: 0, 0: 2}}, "merge each into one that stays"),
        ({0: {5: 0}}, "merge each into one that stays"),
        ({7: {1: 0}}, "layer 7 does not exist"),
    ],
)
def test_a_sharing_no_layout_has_is_refused_before_anything_changes(sharing, match):
    model = eight_over_four("llama")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PlanError, match=match):
        share_kv_heads(model, sharing)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_key_maps_where_keys_are_normalised_per_head_and_fused_projections_are_refused():
    qwen3 = eight_over_four("qwen3")
    pairs = find_attention(qwen3)[0].head_dim // 2
    maps = {find_attention(qwen3)[0].name: {1: torch.full((pairs,), 2.0 + 1.0j, dtype=torch.complex128)}}
    with pytest.raises(PlanError, match="share it without key maps"):
        share_kv_heads(qwen3, {0: {1: 0, 3: 2}}, maps)
    config = T.Phi3Config(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=128,
        pad_token_id=0,
    )
    with pytest.raises(PlanError, match="share one projection"):
        share_kv_heads(T.Phi3ForCausalLM(config).eval(), {0: {1: 0, 3: 2}})


def test_a_record_whose_sharing_was_edited_is_refused(tmp_path):
    model = eight_over_four("llama")
    share_kv_heads(model, {0: {1: 0, 3: 2}})
    ph.save_pruned(model, tmp_path / "shared")
    path = tmp_path / "shared" / "config.json"
    config = json.loads(path.read_text())
    record = config[RECORD_KEY]
    record["layers"]["model.layers.0.self_attn"]["shared"] = {"1": 1, "3": 2}
    record["digest"] = record_digest(record["layers"])
    path.write_text(json.dumps(config))
    with pytest.raises(RecordError, match="merges a KV head into itself"):
        ph.load_pruned(tmp_path / "shared")


def _o_proj_rows(model, layer, batches, sharing=None, maps=None):
    """The layer's output-projection inputs and outputs over the batches' tokens (padding left out), with
    `sharing` run as hooks."""
    seen = []
    o_proj = layer.module.o_proj
    handle = o_proj.register_forward_hook(lambda m, a, out: seen.append((a[0].detach(), out.detach())))
    try:
        with torch.no_grad(), shared_kv([layer], {layer.name: sharing or {}}, {layer.name: maps or {}}):
            for b in batches:
                model(**b)
    finally:
        handle.remove()
    masks = [b["attention_mask"].bool() for b in batches]
    return tuple(torch.cat([pair[i][m] for pair, m in zip(seen, masks)]).double() for i in range(2))


def test_a_shared_refit_is_solved_from_the_recorded_turns_and_its_error_is_the_shared_layers():
    """The refit of a sharing, from the one Gram matrix of the layer's inputs and turns, is the fit of the
    shared layer's own output-projection inputs: its reported error is the shared layer's output error with
    the fitted columns and bias in place."""
    model = eight_over_four("llama")
    layers = find_attention(model)
    batches = [batch(seed, rows=4, tokens=16) for seed in range(4)]
    calibration, _, maps = sharing_statistics(model, layers, batches, batches[:1])
    layer, merges = layers[1], {1: 0, 3: 2}
    fitted = refit(layer, (), calibration[layer.name], None, reads=reading(layer, merges))
    x, _ = _o_proj_rows(model, layer, batches, merges, merge_maps(maps[layer.name], layer, merges))
    _, y = _o_proj_rows(model, layer, batches)  # the unpruned layer's output: the fit's target
    predicted = x @ fitted.weight.double().T + fitted.bias
    error = float(((predicted - y) ** 2).sum() / (y**2).sum())
    assert fitted.fallback is None and 0 < fitted.error < 1
    assert error == pytest.approx(fitted.error, rel=1e-6)


def _planted_statistics(scales: Callable[[int], dict[int, torch.Tensor]]):
    """Layer 1 of a Llama of 8 query heads over 4 KV heads, its attention peaked (a head's output far from its
    mean) and the KV heads `scales(half head_dim)` names planted as rotary scales of the ones before them, with its
    statistics of every turn on 3 calibration batches and 1 held-out: (layer, calibration, held-out)."""
    model = eight_over_four("llama")
    layer = find_attention(model)[1]
    with torch.no_grad():
        layer.module.q_proj.weight.mul_(4)
        layer.module.k_proj.weight.mul_(4)
    tm.plant_scaled_kv_heads(layer, scales(layer.head_dim // 2))
    batches = [batch(seed, rows=4, tokens=16) for seed in range(4)]
    calibration, heldout, _ = sharing_statistics(model, find_attention(model), batches[:3], batches[3:])
    layer = find_attention(model)[1]
    return layer, calibration[layer.name], heldout[layer.name]


def test_where_a_kv_head_is_a_rotary_scale_of_another_sharing_refits_exactly_and_removal_cannot():
    def scales(half: int) -> dict[int, torch.Tensor]:  # KV head 1 a scale of 0, 3 of 2
        scale = torch.complex(*torch.randn(2, half, generator=torch.Generator().manual_seed(5)))
        return dict.fromkeys((1, 3), scale.to(torch.complex128))

    layer, calibration, heldout = _planted_statistics(scales)
    shared = refit(layer, (), calibration, heldout, reads=reading(layer, {1: 0, 3: 2}))
    removed = refit(layer, (2, 3, 6, 7), calibration, heldout)  # with their query heads
    assert shared.error < removed.error / 100


def test_query_heads_of_one_kv_head_re_pointed_to_two_others_refit_exactly_from_the_turns():
    """Eight over two's re-pointing: where KV head 1 is a rotary scale of 0 and 2 one of 1, KV head 1's query
    heads read one KV head 0's and the other KV head 2's keys and values, and the refit of the layer so (each
    head's features from the turn that reads its KV head) fits exactly where removing them cannot."""

    def scales(half: int) -> dict[int, torch.Tensor]:  # KV head 1 a scale of 0, 2 one of 1
        generator = torch.Generator().manual_seed(7)
        return {j: torch.complex(*torch.randn(2, half, generator=generator)).to(torch.complex128) for j in (1, 2)}

    layer, calibration, heldout = _planted_statistics(scales)
    split = refit(layer, (), calibration, heldout, reads={2: 0, 3: 2})
    unrelated = refit(layer, (), calibration, heldout, reads={2: 0, 3: 3})
    removed = refit(layer, (2, 3), calibration, heldout)
    assert split.error < removed.error / 100
    assert unrelated.error > 100 * split.error  # KV head 3's keys are not a scale of 1's


def test_a_plans_cut_is_shared_by_merging_each_emptied_group_into_a_kept_one_keys_most_alike_first():
    """Removing KV groups 0 and 2 of a layer of 4 keeps 1 and 3: without key statistics 0 merges into 1 and 2
    into 3; where KV head 2's keys are a rotary scale of 1's, 2 merges into 1 and 0 into 3. A cut of part of a
    group, of every group or to a count no layout has is not shared."""
    model = eight_over_four("llama")
    layer = find_attention(model)[1]
    scale = torch.complex(*torch.randn(2, layer.head_dim // 2, generator=torch.Generator().manual_seed(6)))
    tm.plant_scaled_kv_heads(layer, {2: scale.to(torch.complex128)})
    products = key_products(model, [layer], [batch(seed) for seed in range(3)])[layer.name]
    assert kv_merges(layer, (0, 1, 4, 5)) == {0: 1, 2: 3}
    assert kv_merges(layer, (0, 1, 4, 5), products) == {2: 1, 0: 3}
    assert kv_merges(layer, (0, 1, 2, 3, 4, 5), products) == {0: 3, 1: 3, 2: 3}
    for removed in ((0,), (0, 1), range(8)):
        assert kv_merges(layer, removed, products) is None


def test_one_sharings_statistics_refit_it_as_every_turns_do_at_a_fraction_of_the_size():
    """The default path records a plan's sharing for its re-pointed heads alone (`SharedStatistics.of`); its refit
    is the one the statistics of every turn give."""
    model = eight_over_four("llama")
    layers = find_attention(model)
    batches = [batch(seed, rows=4, tokens=16) for seed in range(4)]
    layer = layers[1]
    shared = SharedStatistics.of(model, lambda b: model(**b), {layer.name: [2, 3, 6, 7]}, batches[:3], batches[3:])
    merges = shared.merges[layer.name]
    assert set(shared.merges) == {layer.name} and sorted(merges) == [1, 3]
    every, every_held, _ = sharing_statistics(model, layers, batches[:3], batches[3:])
    calibration, heldout = shared.calibration[layer.name], shared.heldout[layer.name]
    narrow = refit(layer, (), calibration, heldout, reads=reading(layer, merges), recorded=[repointed(layer, merges)])
    wide = refit(layer, (), every[layer.name], every_held[layer.name], reads=reading(layer, merges))
    assert narrow.ridge == wide.ridge and narrow.error == pytest.approx(wide.error, rel=1e-6)
    torch.testing.assert_close(narrow.weight, wide.weight, rtol=1e-4, atol=1e-6)
    assert calibration.width < every[layer.name].width / 2
