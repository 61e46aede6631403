import pytest
import tiny_models as tm
import torch
from torch import nn

import prune_heads as ph


class CountingAttention(nn.Module):
    """Looks like Llama attention to the structural match, but reshapes with a head count of its own
    (`self.heads`) that no family's `updates` knows about."""

    def __init__(self, hidden: int = 32, heads: int = 4, sink: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.o_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.num_key_value_groups = 1
        self.sinks = nn.Parameter(torch.randn(heads)) if sink else None  # one value per head, not in the table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        heads = self.heads if self.sinks is None else self.q_proj.out_features // self.head_dim
        q, k, v = (
            p(x).view(b, s, heads, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        scores = q @ k.transpose(-1, -2) / self.head_dim**0.5
        if self.sinks is not None:
            scores = scores + self.sinks[:, None, None]
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, heads * self.head_dim)
        return self.o_proj(out)


class WeightCountingAttention(CountingAttention):
    """Reads its head count from the weights, as transformers' modules do: pruning it is exact."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.heads = self.q_proj.out_features // self.head_dim
        return super().forward(x)


class Tiny(nn.Module):
    main_input_name = "x"

    def __init__(self, attention: type = CountingAttention, **kwargs) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([attention(**kwargs) for _ in range(2)])

    def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
        for block in self.blocks[:depth]:
            x = x + block(x)
        return x


def test_a_structural_match_that_would_crash_is_refused_untouched():
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(2, 5, 32)
    layers = ph.find_attention(model)
    assert len(layers) == 2  # matched by structure: no family names CountingAttention
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ph.PlanError,
        match=r"blocks.0 \(CountingAttention, handled as '\w+' by its structure\): "
        r"it fails after the removal.*nothing was changed",
    ):
        ph.prune(model, {0: [1]}, inputs={"x": x})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    model(x)  # still runs


def test_one_value_per_head_is_found_and_sliced_with_the_heads():
    torch.manual_seed(0)
    model, x = Tiny(sink=True), torch.randn(2, 5, 32)  # sinks: [heads], as GPT-OSS keeps them
    assert ph.find_attention(model)[0].spec.per_head_params == ("sinks",)
    with ph.head_gates(model) as gates, torch.no_grad():
        gates[0][1] = 0.0
        expected = model(x)
    ph.prune(model, {0: [1]}, inputs={"x": x})
    assert model.blocks[0].sinks.shape == (3,)
    torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-5)


def test_a_structural_match_that_is_exact_is_accepted():
    torch.manual_seed(0)
    model, x = Tiny(WeightCountingAttention), torch.randn(2, 5, 32)
    with ph.head_gates(model) as gates, torch.no_grad():
        gates[0][1] = 0.0
        expected = model(x)
    ph.prune(model, {0: [1]}, inputs={"x": x})
    torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-5)


def test_layers_the_random_pass_does_not_reach_are_refused_unless_the_table_knows_them():
    torch.manual_seed(0)
    model = Tiny()
    with pytest.raises(ph.PlanError, match="did not reach it"):
        ph.prune(model, {1: [1]}, inputs={"x": torch.randn(2, 5, 32), "depth": 1})
    with pytest.raises(ph.PlanError, match="it fails with gates on its inputs"):
        ph.prune(model, {0: [1]}, inputs={"x": torch.randn(2, 5, 7)})  # inputs the model cannot take
    assert [l.num_heads for l in ph.find_attention(model)] == [4, 4]
    bert = tm.build("bert")  # a table family is trusted where the pass cannot reach it
    ph.prune(bert, {0: [1]}, inputs={"not_an_input": torch.zeros(1)})
    assert ph.find_attention(bert)[0].num_heads == 3


@pytest.mark.parametrize("name", list(tm.FAMILIES))
def test_every_family_passes_its_probe_on_random_inputs(name):
    model = tm.build(name)
    layers = ph.find_attention(model)
    plan = tm.uneven_plan(layers)
    ph.probe_plan(model, layers, {layers[i].name: heads for i, heads in plan.items()})  # raises if not exact


def test_an_emptied_bloom_layer_is_refused_by_its_probe():
    model = tm.build("bloom")  # its attention adds the residual itself: no no-heads forward for it
    with pytest.raises(ph.PlanError, match=r"transformer.h.1.self_attention .* it fails after the removal"):
        ph.prune(model, {1: [0, 1, 2, 3]})
    assert ph.find_attention(model)[1].num_heads == 4


def test_layers_that_normalise_over_all_heads_are_refused_with_the_reason():
    from transformers import Olmo2Config, Olmo2ForCausalLM

    model = Olmo2ForCausalLM(Olmo2Config(**{**tm.COMMON, "num_key_value_heads": 2})).eval()
    with pytest.raises(ph.PlanError, match="its q_norm normalises over all heads together"):
        ph.prune(model, {0: [0, 1]})


def test_a_refused_plan_undoes_the_preparation(monkeypatch):
    """T5's preparation gives each layer its own relative-bias table; a plan the probe then refuses leaves
    no table, hook or attribute of it behind, and the outputs as they were."""
    import prune_heads.model.probe as probe

    model = tm.build("t5")
    inputs = tm.make_inputs("t5", seed=3)
    keys, hooks = model.state_dict().keys(), [len(m._forward_pre_hooks) for m in model.modules()]
    with torch.no_grad():
        before = model(**inputs).logits
    monkeypatch.setattr(probe, "_differs", lambda layer, heads, call: "refused for the test")
    with pytest.raises(ph.PlanError, match="refused for the test"):
        ph.prune(model, {2: [0]})  # a later block's layer: its bias table would be a new copy
    assert model.state_dict().keys() == keys and [len(m._forward_pre_hooks) for m in model.modules()] == hooks
    assert not any(hasattr(m, "_ph_own_bias") for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, before, rtol=0, atol=0)
    monkeypatch.undo()
    ph.prune(model, {2: [0]})  # and the same plan, accepted, prepares and prunes as usual
    assert len(model.state_dict()) > len(keys)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_is_proven_on_its_structure_not_its_rounding(dtype):
    """bfloat16 rounding alone is over the probe's float32 tolerance: the copies are proven in float32, and the
    model itself stays in its dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=576,
            intermediate_size=64,
            num_hidden_layers=12,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=128,
        )
    ).to(dtype)
    layers = ph.find_attention(model)
    ph.probe_plan(model, layers, {layer.name: [0, 1, 2] for layer in layers})  # raises if not exact
    assert all(p.dtype == dtype for p in model.parameters())


def test_a_module_used_at_several_depths_is_proven_on_each_of_its_calls():
    from prune_heads.model.probe import CALLS, capture_calls

    albert = tm.build("albert")  # one layer object called at every depth, with other inputs each time
    layers = ph.find_attention(albert)
    calls, failure = capture_calls(albert, layers, None)
    depth = albert.config.num_hidden_layers
    assert failure is None and len(calls[layers[0].name]) == min(CALLS, depth) > 1
    first, second = (c[0][0] if c[0] else next(iter(c[1].values())) for c in calls[layers[0].name][:2])
    assert not torch.equal(first, second)  # other inputs at the second depth
