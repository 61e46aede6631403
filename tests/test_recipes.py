import pytest
import tiny_models as tm
import torch

from prune_heads.budgets import resolve_budget
from prune_heads.config import PruneConfig, SelectionConfig
from prune_heads.errors import ConfigError
from prune_heads.export.persistence import stock_config
from prune_heads.model.layers import find_attention
from prune_heads.pruner import prune_model
from prune_heads.recipes import RecipeError, load_recipe, parse_recipe, shipped_recipes
from prune_heads.task_data import TaskData

# hub recipe -> the tiny random stand-in of the same family used to build its pipeline here (no hub)
STAND_INS = {
    "bert-base-sst2": "bert",
    "bert-base-mnli": "bert",
    "distilbert-sst2": "distilbert",
    "roberta-base-mnli": "roberta",
    "gpt2-wikitext2": "gpt2",
    "qwen2.5-0.5b-wikitext2": "qwen2",
    "vit-base-beans": "vit",
    "all-minilm-l6-v2-embeddings": "bert",
    "smollm2-135m-gguf": "llama",
    "demo-smollm2-gguf": "llama",
}


def test_every_shipped_recipe_validates():
    names = set(shipped_recipes())
    assert set(STAND_INS) | {"fixture-minilm-sentiment", "demo-minilm-embeddings"} == names
    for name in names:
        recipe = load_recipe(name)
        assert recipe.description and recipe.output


def _synthetic(name: str, recipe) -> TaskData:
    batches = [tm.make_inputs(name, batch=4, seed=s) for s in range(2)]
    for batch in batches:
        if recipe.task == "causal-lm":
            batch["labels"] = batch["input_ids"].clone()
        elif recipe.task in ("classification", "image-classification"):
            batch["labels"] = torch.tensor([0, 1, 1, 0])
    return TaskData(recipe.task, batches, 8)


@pytest.mark.parametrize("recipe_name", sorted(STAND_INS))
def test_hub_recipes_build_their_pipeline_on_a_stand_in(recipe_name):
    recipe = load_recipe(recipe_name)
    family = STAND_INS[recipe_name]
    model = tm.build(family)
    if recipe.task == "feature-extraction":
        model = model.bert
    total = sum(layer.num_heads for layer in find_attention(model))
    # the tiny stand-in has other head counts than the hub model: take the nearest budget its structure allows
    selection = SelectionConfig(**{**vars(recipe.selection), "round": "nearest"})
    config = PruneConfig(selection=selection, scoring=recipe.scoring, recovery=recipe.recovery)
    expected = resolve_budget(model, config).removes
    found = prune_model(model, _synthetic(family, recipe), config, progress=False)
    assert found.heads_removed == expected > 0
    assert sum(layer.num_heads for layer in find_attention(model)) == total - expected
    assert found.scores.method == recipe.scoring.method
    if recipe.selection.uniform:  # every layer kept the same heads: a stock config is saved
        assert stock_config(model) is not None


def _base():
    return {"model": "m", "data": {"source": "d"}, "selection": {"sparsity": 0.5}}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"data": {"source": "d", "txt_column": "x"}}, "unknown key data.txt_column: did you mean 'text_column'\\?"),
        ({"selction": {}}, "unknown key selction: did you mean 'selection'\\?"),
        ({"selection": {"sparsity": "half"}}, "selection.sparsity must be float | None, not 'half'"),
        ({"model": None}, "model must be str"),
        ({"scoring": {"method": "magic"}}, "scoring.method is 'magic'; choose one of ablation, activation"),
        ({"task": "translation"}, "task is 'translation'; choose one of classification"),
        (
            {"selection": {"sparsity": 0.5, "num_heads": 3}},
            "exactly one of sparsity, num_heads, keep_per_layer, flops, kv_cache or max_loss",
        ),
        ({"selection": {"max_loss": 3, "flops": 0.5}}, "exactly one of .* \\(has \\['flops', 'max_loss'\\]\\)"),
        ({"evaluation": {"speed": {"repeats": 2.5}}}, "evaluation.speed.repeats must be int"),
        (
            {"scoring": {"steps": 3}},
            "scoring.steps > 1 prunes iteratively, which recovery cannot follow; set recovery: off",
        ),
        ({"selection": {"sparsity": 0.5, "gqa": "uniform"}}, "selection.gqa is 'uniform'; choose one of groups, even"),
        (
            {"selection": {"sparsity": 0.5, "round": "up-ish"}},
            "selection.round is 'up-ish'; choose one of down, nearest",
        ),
        ({"recovery": {"gate_tunning": True}}, "unknown key recovery.gate_tunning: did you mean 'gate_tuning'\\?"),
    ],
)
def test_bad_recipes_name_the_key(change, message):
    data = {**_base(), **change}
    with pytest.raises(RecipeError, match=message):
        parse_recipe(data)


def test_missing_field_and_overrides():
    with pytest.raises(RecipeError, match="selection is missing"):
        parse_recipe({"model": "m", "data": {"source": "d"}})
    assert parse_recipe({"model": "m", "task": "causal-lm", "selection": {"sparsity": 0.5}}).data.source is None
    recipe = parse_recipe(
        _base(), ["selection.sparsity=0.25", "evaluation.speed=null", "scoring.steps=3", "recovery=off"]
    )
    assert recipe.selection.sparsity == 0.25 and recipe.evaluation.speed is None and recipe.scoring.steps == 3
    with pytest.raises(RecipeError, match="--set takes key=value"):
        parse_recipe(_base(), ["selection.sparsity"])


def test_corrupt_yaml_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: m\ndata: [unclosed\n")
    with pytest.raises(RecipeError, match="is not valid YAML at line 3"):
        load_recipe(str(path))
    with pytest.raises(RecipeError, match="no recipe file or shipped recipe named 'nope'; shipped: all-minilm"):
        load_recipe("nope")


def test_recovery_section_maps_onto_prune_model():
    recipe = parse_recipe({**_base(), "recovery": {"holdout": 0, "rearrange": False, "epochs": 1}})
    model = tm.build("bert")
    before = {l.name: l.module.output.dense.bias.clone() for l in find_attention(model)}
    found = prune_model(model, _synthetic("bert", recipe), PruneConfig.from_recipe(recipe), progress=False)
    assert found.heads_removed == 6
    assert [e["step"] for e in found.recovery] == ["selection", "gate, bias and projection tuning"]
    assert found.recovery[0]["kept"] == "ranked + reconstruction"  # no hold-out: every enabled step
    assert any(not torch.equal(l.module.output.dense.bias, before[l.name]) for l in find_attention(model))
    off = parse_recipe({**_base(), "recovery": "off"})
    assert not off.recovery.enabled
    assert parse_recipe({**_base(), "recovery": False}).recovery == off.recovery


def test_a_heal_is_a_recovery_key_and_its_corpus_a_data_key():
    recipe = parse_recipe({**_base(), "recovery": {"heal": "2M", "heal_every": "250k"}, "data": {"heal_source": "c"}})
    assert (recipe.recovery.heal, recipe.recovery.heal_every) == (2_000_000, 250_000)
    assert (recipe.data.heal_source, recipe.data.heal_split) == ("c", "train")
    with pytest.raises(ConfigError, match="recovery.heal is 'lots'; give a whole number of tokens"):
        parse_recipe({**_base(), "recovery": {"heal": "lots"}})


def test_omitted_sections_are_the_default_path():
    recipe = parse_recipe(_base())
    assert PruneConfig.from_recipe(recipe) == PruneConfig(selection=SelectionConfig(sparsity=0.5))


def test_a_flops_budget_becomes_a_head_count():
    from prune_heads.model.inputs import dummy_inputs
    from prune_heads.runtime.work import count_flops

    recipe = parse_recipe(
        {"model": "m", "data": {"source": "d"}, "selection": {"flops": 0.85}, "evaluation": {"speed": {"seq_len": 16}}}
    )
    model = tm.build("bert")
    inputs = dummy_inputs(model, 1, 16)
    before = count_flops(model, inputs)
    found = prune_model(model, _synthetic("bert", recipe), PruneConfig.from_recipe(recipe), progress=False)
    assert found.plan and count_flops(model, inputs) <= 0.85 * before
    with pytest.raises(RecipeError, match="selection.flops needs scoring.steps 1"):
        parse_recipe({"model": "m", "data": {"source": "d"}, "selection": {"flops": 0.85}, "scoring": {"steps": 3}})
