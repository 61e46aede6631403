"""`analyze` and its page: the importance it reports is the scorer's, the redundancy finds planted duplicates, the
behaviour of known attention patterns, cuts measured as physical removal measures them, the model and the
caller's state left as they were, and a page that a browser renders offline."""

import base64
import copy
import io
import re
import shutil
import subprocess

import pytest
import tiny_models as tm
import torch
from PIL import Image

import prune_heads as ph
from prune_heads.errors import ConfigError
from prune_heads.evaluation.analysis import Analysis, analyze
from prune_heads.evaluation.analysis.page import page, write_page
from prune_heads.evaluation.analysis.sums import LayerSums, add_behaviour
from prune_heads.model.layers import qkv_parts, resolve
from prune_heads.scoring.objective import Objective

FAMILIES = [name for name, spec in tm.FAMILIES.items() if spec[3] in ("encoder", "decoder")]


@pytest.fixture(scope="module")
def llama():
    model = tm.build("llama", attn="sdpa")
    return model, tm.batches("llama", n=6, batch=4), analyze(model, tm.batches("llama", n=6, batch=4), progress=False)


def test_importance_is_the_fisher_score_per_example(llama):
    model, batches, found = llama
    scores = ph.score_heads(model, batches, method="fisher", progress=False)
    for layer in found.layers:
        expected = scores.scores[layer.name].double() / found.examples
        assert torch.allclose(torch.tensor(layer.importance, dtype=torch.float64), expected, rtol=1e-4, atol=1e-12)
        assert all(lo <= v <= hi for lo, v, hi in zip(layer.low, layer.importance, layer.high))
        assert all(lo <= r <= hi for lo, r, hi in zip(layer.rank_low, layer.rank, layer.rank_high))
    ranks = sorted(r for layer in found.layers for r in layer.rank)
    assert ranks == list(range(len(ranks))) and 0 < found.rank_agreement <= 1


def test_model_and_random_state_are_left_as_they_were(llama):
    model, batches, found = llama
    before = model(**batches[0]).logits
    with tm.random_state_kept():
        again = analyze(model, batches, progress=False)
    assert again == found  # same inputs and seed: the same analysis
    assert model.config._attn_implementation == "sdpa" and not model.training
    assert all(p.requires_grad for p in model.parameters())
    assert torch.equal(model(**batches[0]).logits, before)


def test_saved_analysis_reads_back_equal(llama, tmp_path):
    _, _, found = llama
    path = write_page(found, tmp_path)
    assert Analysis.load(tmp_path / "analysis.json") == found and path.name == "analysis.html"


def test_a_cut_costs_what_the_physically_pruned_model_diverges(llama):
    model, batches, found = llama
    objective, cut = Objective(model), found.costs[1]
    pruned = copy.deepcopy(model)
    layers = ph.find_attention(pruned)
    ph.prune(pruned, {layer.index: list(dict(cut.plan).get(layer.name, ())) for layer in layers})
    values = []
    with torch.no_grad():
        for batch in batches[1::2]:  # the batches the cuts are measured on
            reference = objective.reference(model(**batch), batch)
            values.append(objective.divergence(pruned(**batch), batch, reference))
    assert float(torch.cat(values).mean()) == pytest.approx(cut.divergence, rel=1e-4)
    assert cut.low <= cut.divergence <= cut.high and cut.examples == 12
    assert cut.heads == cut.units * 2 and found.unit == "KV group"  # whole KV groups of two query heads
    assert [c.heads for c in found.costs] == sorted(c.heads for c in found.costs)
    assert found.passes <= 2


def _copy_head(model, layer, source: int, target: int) -> None:
    """Make query head `target` of a plain multi-head layer compute what head `source` computes."""
    parts, _ = qkv_parts(layer.module, layer.spec, layer.num_heads, layer.head_dim)
    with torch.no_grad():
        for slot in parts.values():
            rows_from, rows_to = slot.features([source], layer.head_dim), slot.features([target], layer.head_dim)
            weight = slot.projection.matrix()
            weight[rows_to] = weight[rows_from]
            if slot.projection.module.bias is not None:
                slot.projection.module.bias[rows_to] = slot.projection.module.bias[rows_from]
        o = resolve(layer.module, layer.spec.o).weight
        d = layer.head_dim
        o[:, target * d : (target + 1) * d] = o[:, source * d : (source + 1) * d]


def test_planted_duplicate_heads_and_kv_heads_are_listed():
    bert = tm.build("bert")
    layer = ph.find_attention(bert)[1]
    _copy_head(bert, layer, 0, 2)
    found = analyze(bert, tm.batches("bert", n=2), progress=False)
    pairs = [(p.layer, p.a, p.b, p.kind) for p in found.duplicates]
    assert (layer.name, 0, 2, "heads") in pairs
    assert found.layers[1].similarity[0][2] == pytest.approx(1.0, abs=1e-5)
    llama = tm.build("llama")
    layer = ph.find_attention(llama)[2]
    parts, _ = qkv_parts(layer.module, layer.spec, layer.num_heads, layer.head_dim)
    with torch.no_grad():
        for name in "kv":
            weight = parts[name].projection.matrix()
            weight[parts[name].features([1], layer.head_dim)] = weight[parts[name].features([0], layer.head_dim)]
    found = analyze(llama, tm.batches("llama", n=2), progress=False)
    assert (layer.name, 0, 1, "kv") in [(p.layer, p.a, p.b, p.kind) for p in found.duplicates]
    assert found.layers[2].key_share[0][1] == pytest.approx(1.0, abs=1e-6)
    assert found.layers[2].value_share[1][0] == pytest.approx(1.0, abs=1e-6)
    assert found.layers[0].key_share[0][1] < 0.75  # random KV heads explain little of each other


def test_behaviour_of_known_attention_patterns():
    layer = ph.find_attention(tm.build("bert"))[0]
    sums = LayerSums.of(layer)
    length = 5
    weights = torch.zeros(1, 4, length, length)
    weights[0, 0, :, 0] = 1  # every query on the first token
    for q in range(length):
        weights[0, 1, q, max(q - 1, 0)] = 1  # the previous token
        weights[0, 2, q, q] = 1  # itself
        weights[0, 3, q, : q + 1] = 1 / (q + 1)  # evenly over what a causal head sees
    mask = torch.tensor([[0, 1, 1, 1, 1]])  # one position of left padding: the first token is position 1
    weights[0, :, :, 0], weights[0, 0, :, 1] = 0, 1
    weights[0, 1, 2, 1] = 1
    add_behaviour(sums, weights, mask)
    entropy, distance, first, previous, same = (sums.behaviour / sums.queries).tolist()
    assert sums.queries == 3  # positions 2, 3 and 4: the first token's own row is left out
    assert first[0] == 1 and previous[1] == 1 and same[2] == 1
    assert entropy[:3] == [0, 0, 0] and distance[1] == 1 and distance[2] == 0
    assert entropy[3] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_every_text_family_is_analysed(family):
    model = tm.build(family)
    found = analyze(model, tm.batches(family, n=2), progress=False)
    assert len(found.layers) == len(ph.find_attention(model)) and found.costs
    assert all(layer.entropy is not None and min(layer.entropy) >= 0 for layer in found.layers)
    assert all(0 <= share <= 1 + 1e-5 for layer in found.layers for share in layer.first)


def test_data_without_rows_is_refused():
    with pytest.raises(ConfigError, match="no rows after tokenization"):
        analyze(tm.build("bert"), [], progress=False)


def _images(html: str) -> list[Image.Image]:
    return [
        Image.open(io.BytesIO(base64.b64decode(data)))
        for data in re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    ]


def test_the_page_is_self_contained_and_marks_the_removed_heads(llama):
    _, _, found = llama
    name = found.layers[0].name
    html = page(found, {name: [0, 1]})
    assert all(src.startswith("data:image/png") for src in re.findall(r'src="([^"]*)"', html))  # nothing fetched
    assert "<script" not in html and "<link" not in html
    assert len(_images(html)) == 6  # importance, its intervals, redundancy, KV heads, behaviour, the cuts' cost
    assert "2 heads removed" in html and len(html) < 3 * 2**20


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Chromium (Debian: apt-get install chromium)")
def test_a_browser_renders_the_page_offline(llama, tmp_path):
    _, _, found = llama
    path = write_page(found, tmp_path, {found.layers[0].name: [0]})
    shot = tmp_path / "shot.png"
    command = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1000,2400"]
    subprocess.run([*command, f"--screenshot={shot}", path.as_uri()], capture_output=True, timeout=120, check=True)
    image = Image.open(shot)
    assert image.size == (1000, 2400)
    assert len(set(image.convert("L").resize((50, 120)).getdata())) > 20  # drawn, not a blank page
    dom = subprocess.run([*command, "--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.stdout.count("<img") == 6 and all(im.size[0] > 100 for im in _images(dom.stdout))


def test_an_offloaded_model_gives_the_analysis_of_the_whole_one(llama):
    from test_onload import offloaded

    _, batches, whole = llama
    model = offloaded("llama")
    model.config._attn_implementation = "sdpa"  # as the shared fixture's
    found = analyze(model, batches, progress=False)
    assert found.layers == whole.layers and found.costs == whole.costs
