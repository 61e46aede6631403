import copy
import dataclasses
import inspect
import json
import math
import typing

import pytest
import tiny_models as tm
import torch

import prune_heads as ph
from prune_heads.pruner import records
from prune_heads.recovery.gated import GatedModel
from prune_heads.recovery.general import SHARE
from prune_heads.recovery.holdout import sequence_nll, split_holdout
from prune_heads.recovery.tuning import Schedule, tune
from prune_heads.runtime.ledger import Stage
from prune_heads.runtime.work import Pricer, WorkLimit
from prune_heads.scoring.methods import score_heads
from prune_heads.scoring.objective import Objective, neighbour_divergence


def reachable_records(root: type) -> set[type]:
    """Every dataclass reachable from `root` through its fields' types (unions and containers opened)."""
    seen, todo = set(), [root]
    while todo:
        kind = todo.pop()
        if dataclasses.is_dataclass(kind) and isinstance(kind, type) and kind not in seen:
            seen.add(kind)
            todo.extend(typing.get_type_hints(kind, localns=vars(inspect.getmodule(kind))).values())
        elif not isinstance(kind, type):
            todo.extend(typing.get_args(kind))
    return seen


def test_the_flow_s_records_are_frozen_and_its_work_adds_up():
    """No stage rewrites what an earlier one made: every record the flow hands on is a frozen dataclass, and the
    ledger's stages, the scoring pass among them, add up to its total."""
    made = [c for _, c in inspect.getmembers(records, inspect.isclass) if c.__module__ == records.__name__]
    assert {c.__name__ for c in made} == {"Run", "Bench", "Scored", "Chosen", "Tuned", "PruneResult"}
    assert all(dataclasses.is_dataclass(c) and c.__dataclass_params__.frozen for c in made)
    config = ph.PruneConfig(ph.SelectionConfig(num_heads=4))
    result = ph.prune_model(tm.build("llama"), tm.batches("llama"), config, progress=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.plan = {}
    mutable = {c.__name__ for root in made for c in reachable_records(root) if not c.__dataclass_params__.frozen}
    assert not mutable, f"records the flow hands on, or holds, that can be changed: {mutable}"
    work = result.work
    assert work.total == pytest.approx(sum(work.stages.values()), rel=1e-12) and work.as_dict()["total"] == work.total
    assert work[Stage.SCORING] == work.calibration_pass  # fisher's scoring pass: one forward and backward pass
    counted = {Stage.SCORING, Stage.RECORDING, Stage.SEARCH, Stage.SELECTION, Stage.RECONSTRUCTION, Stage.TUNING}
    assert counted | {Stage.GENERATION, Stage.PERPLEXITY} == set(work.stages)  # the guard's own text has labels
    domain_only = ph.PruneConfig(ph.SelectionConfig(num_heads=4), recovery=ph.RecoveryConfig(general="off"))
    alone = ph.prune_model(tm.build("llama"), tm.batches("llama"), domain_only, progress=False).work
    assert counted == set(alone.stages)  # no labels: no perplexity measured
    tuning = next(e for e in result.recovery if "tuning" in e["step"])
    assert tuning["flops"] == work[Stage.TUNING]


def test_a_refit_that_fell_back_in_the_state_kept_is_noted_once():
    """The report's notes name each layer whose refit in the kept state fell back to bias compensation, and why,
    once, though every candidate tried refitted it (7 calibration tokens for 17 unknowns per output)."""
    config = ph.PruneConfig(ph.SelectionConfig(num_heads=4), recovery=ph.RecoveryConfig(general="off"))
    result = ph.prune_model(tm.build("llama"), tm.batches("llama", n=1, batch=1), config, progress=False)
    selection = next(e for e in result.recovery if e["step"] == "selection")
    notes = next(e["notes"] for e in result.recovery if e["step"] == "notes")
    assert selection["kept"].endswith("reconstruction") and len(selection["tried"]) > 2
    assert selection["reconstruction"]["ridges"] == {"bias compensation": 2}
    why = "reconstruction fell back to bias compensation: the fit has 17 unknowns per output and the calibration"
    assert notes == [f"model.layers.{i}.self_attn: {why} data gave 7 tokens; give at least 17 tokens" for i in (0, 1)]


def kl(model, reference, data):
    objective = Objective(reference)
    with torch.no_grad():
        return sum(
            float(objective.divergence(model(**b), b, objective.reference(reference(**b), b)).sum()) for b in data
        )


def test_default_config_is_the_best_measured_path():
    config = ph.PruneConfig()
    assert config.scoring.method == "fisher" and config.selection.sparsity == 0.5
    r = config.recovery
    steps = (r.rearrange, r.reconstruction, r.bias_compensation, r.gate_tuning, r.bias_tuning, r.projection_tuning)
    assert steps == (True,) * 6 and r.holdout == 0.2 and r.tuning_budget is None  # the held-out stop decides
    assert not ph.RecoveryConfig.off().enabled


def test_the_default_tunes_until_the_heldout_stop_and_reports_its_work_as_strict_json():
    model = tm.build("llama")
    config = ph.PruneConfig(selection=ph.SelectionConfig(num_heads=4))
    result = ph.prune_model(model, tm.batches("llama", n=10, labels=False), config, progress=False)
    tuning = next(e for e in result.recovery if "tuning" in e["step"])
    assert tuning["budget_flops"] is None and result.work.tuning_budget is None and tuning["flops"] > 0
    assert 0 < tuning["epochs_run"] <= config.recovery.epochs
    json.loads(json.dumps(result.work.as_dict(), allow_nan=False))  # no Infinity for a pipeline's JSON parser


def test_a_language_model_reports_its_heldout_perplexity_change():
    """The held-out summary's perplexity change is what the pruned model and an unpruned copy give on the
    held-out examples; a classifier has none."""
    model = tm.build("llama")
    data = _labelled("llama")
    original = copy.deepcopy(model)
    result = ph.prune_model(model, data, ph.PruneConfig(selection=ph.SelectionConfig(num_heads=4)), progress=False)
    _, heldout = split_holdout(data, 0.2)
    nll = [sequence_nll(lambda b, m=m: m(**b), heldout, torch.device("cpu")).mean for m in (original, model)]
    assert result.heldout["perplexity_change"] == pytest.approx(math.exp(nll[1] - nll[0]) - 1, rel=1e-5, abs=1e-7)
    # before and after, on the held-out set and on the guard's text reported beside it (half as many examples)
    assert result.work[Stage.PERPLEXITY] == pytest.approx(2 * (1 + SHARE) * result.work.heldout_pass)
    bert = ph.prune_model(tm.build("bert"), tm.batches("bert"), ph.PruneConfig(), progress=False)
    assert "perplexity_change" not in bert.heldout and Stage.PERPLEXITY not in bert.work


def _labelled(name: str, n: int = 10) -> list[dict]:
    return [dict(b, labels=b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)) for b in tm.batches(name, n=n)]


def test_a_loss_bound_removes_exactly_the_groups_that_cost_nothing_and_no_more():
    """A known answer: a tiny Llama whose second KV group writes nothing in layers 0 and 2 (its output columns
    zeroed) loses exactly those two groups under a bound of 0.001%, every deeper prefix measured above it."""
    model, silent = _silent_llama()
    config = ph.PruneConfig(selection=ph.SelectionConfig(max_loss=0.001))
    result = ph.prune_model(model, _labelled("llama"), config, progress=False)
    assert result.plan == silent and result.asked == 4
    depth = result.heldout["max_loss"]
    assert depth["heads"] == 4 and depth["bound"] == pytest.approx(1e-5) and "refitted" in depth["rule"]
    rises = dict((heads, rise) for heads, rise in depth["rises"])
    assert abs(rises[4]) <= 1e-5 and all(rise > 1e-5 for heads, rise in rises.items() if heads > 4)
    assert any(heads > 4 for heads in rises) and result.work[Stage.DEPTH] > 0
    assert abs(result.heldout["perplexity_change"]) <= 1e-5  # after the whole flow, as measured there
    other = ph.prune_model(tm.build("llama"), _labelled("llama"), config, progress=False)  # no silent group
    deepest = other.heldout["max_loss"]["heads"]
    rises = dict((heads, rise) for heads, rise in other.heldout["max_loss"]["rises"])
    assert all(rises[h] <= 1e-5 for h in rises if h <= deepest) and all(rises[h] > 1e-5 for h in rises if h > deepest)
    assert max(other.heldout["perplexity_change"], other.heldout["general_perplexity_change"]) <= 1e-5


def test_a_loss_bound_on_a_classifier_measures_its_labels_along_the_ranking():
    """A known answer on a classifier, where no search runs: a tiny BERT whose fourth head writes nothing in
    layers 0 and 2 loses exactly those two heads under a bound of 0.001% on its held-out label perplexity (the
    exp of the mean cross-entropy), measured along the plain ranking's order; the rise is the cross-entropy's
    measured by hand."""
    model = tm.sensitive(tm.build("bert"))
    layers = ph.find_attention(model)
    with torch.no_grad():
        for layer in (layers[0], layers[2]):
            layer.module.output.dense.weight[:, 24:] = 0
    original, data = copy.deepcopy(model), tm.batches("bert", n=10)
    config = ph.PruneConfig(selection=ph.SelectionConfig(max_loss=0.001))
    result = ph.prune_model(model, data, config, progress=False)
    assert result.plan == {layers[0].name: [3], layers[2].name: [3]} and Stage.SEARCH not in result.work
    rises = dict((heads, rise) for heads, rise in result.heldout["max_loss"]["rises"])
    assert abs(rises[2]) <= 1e-5 and all(rise > 1e-5 for heads, rise in rises.items() if heads > 2)
    assert "depths measured along the plain ranking's order (no search ran)" in result.recovery[0]["notes"]
    _, heldout = split_holdout(data, 0.2)

    def cross_entropy(m: torch.nn.Module) -> float:
        with torch.no_grad():
            losses = [torch.nn.functional.cross_entropy(m(**b).logits, b["labels"], reduction="sum") for b in heldout]
        return float(sum(losses)) / sum(len(b["labels"]) for b in heldout)

    change = math.exp(cross_entropy(model) - cross_entropy(original)) - 1
    assert result.heldout["perplexity_change"] == pytest.approx(change, abs=1e-9)


def test_a_given_plan_gets_the_recovery_the_default_path_gives_it():
    """A plan given whole (a frontier depth's, say) is removed with the default recovery and no scoring, search
    or other candidate: where the default path kept its own plan with its reconstruction, the given plan
    reproduces that model exactly, for less work. A loss bound or depths beside a plan are refused."""
    data, config = _labelled("llama"), ph.PruneConfig(selection=ph.SelectionConfig(num_heads=4))
    default_model, given_model = tm.build("llama"), tm.build("llama")
    default = ph.prune_model(default_model, data, config, progress=False)
    assert next(s for s in default.recovery if s["step"] == "selection")["kept"].endswith(" + reconstruction")
    given = ph.prune_model(given_model, data, progress=False, plan=default.plan)
    assert given.plan == default.plan and given.scores is None and Stage.SEARCH not in given.work
    selection = next(s for s in given.recovery if s["step"] == "selection")
    assert list(selection["tried"]) == ["given", "given + reconstruction"]
    assert selection["kept"] == "given + reconstruction"
    a, b = default_model.state_dict(), given_model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert given.work.total < default.work.total and Stage.SCORING not in given.work
    for selection in (ph.SelectionConfig(max_loss=3.0), ph.SelectionConfig(depths="1/3")):
        with pytest.raises(ph.ConfigError, match="a plan was given: leave out one of them"):
            ph.prune_model(tm.build("llama"), data, ph.PruneConfig(selection=selection), plan=default.plan)


def _silent_llama() -> tuple[torch.nn.Module, dict[str, list[int]]]:
    """A tiny Llama whose second KV group writes nothing in layers 0 and 2 (its output columns zeroed), and
    those groups' query heads (2 and 3, head size 8)."""
    model = tm.build("llama")
    layers = ph.find_attention(model)
    with torch.no_grad():
        for layer in (layers[0], layers[2]):
            layer.module.o_proj.weight[:, 16:] = 0
    return model, {layers[0].name: [2, 3], layers[2].name: [2, 3]}


def test_a_frontier_measures_each_depth_of_one_order_and_keeps_the_budgets():
    """A known answer: on the tiny Llama with two silent KV groups, the frontier at 1/6 and 1/3 of the heads
    costs nothing (the silent groups lead the searched order) and 1/2 costs more; its rise at each depth is the
    loss bound's at the same depth (one measurement, the lower of removal's and its shared row's); the model kept
    is the budget's depth; the KV cache and parameters are those of the plan at each depth."""
    model, silent = _silent_llama()
    config = ph.PruneConfig(selection=ph.SelectionConfig(max_loss=0.001, depths="1/6,1/3,1/2"))
    result = ph.prune_model(model, _labelled("llama"), config, progress=False, eval_data=_labelled("llama", 4))
    assert result.plan == silent
    expected = [(0.0, 0, 0), (1 / 6, 1, 2), (1 / 3, 2, 4), (1 / 2, 3, 6)]  # the unpruned model first
    assert [(d.share, d.units, d.heads) for d in result.frontier] == expected
    unpruned, shallow, middle, deep = result.frontier
    assert unpruned.perplexity_change == unpruned.eval_change == 0 and unpruned.plan == {}
    assert middle.plan == silent and shallow.plan.items() <= silent.items()
    assert abs(shallow.perplexity_change) <= 1e-5 and abs(middle.perplexity_change) <= 1e-5
    assert deep.perplexity_change > 1e-5 and deep.interval[0] <= deep.perplexity_change <= deep.interval[1]
    assert abs(middle.eval_change) <= 1e-5 and deep.eval_change > 1e-5
    rises = dict(result.heldout["max_loss"]["rises"])  # the bound's: on the calibration's text, eval_data reported
    assert rises[6] == pytest.approx(min(d.perplexity_change for d in (deep, deep.shared) if d), rel=1e-9)
    weighed = dataclasses.replace(config, recovery=ph.RecoveryConfig(general="weigh"))
    model, _ = _silent_llama()
    again = ph.prune_model(model, _labelled("llama"), weighed, progress=False, eval_data=_labelled("llama", 4))
    deep = again.frontier[-1]  # weighed, the bound holds on both texts
    assert again.plan == silent
    worst = min(max(d.perplexity_change, d.eval_change) for d in (deep, deep.shared) if d)  # the lower way's
    assert dict(again.heldout["max_loss"]["rises"])[6] == pytest.approx(worst)
    assert [d.kv_cache for d in result.frontier] == [
        {"f16": 2 * 8192 * 8 * 2 * (6 - k)} for k in range(4)
    ]  # key and value, f16
    parameters = sum(p.numel() for p in tm.build("llama").parameters())
    per_group = 2 * (32 * 8 + 8 * 32) + 2 * 8 * 32  # two query heads (q rows, o columns), a key and a value
    assert [d.parameters for d in result.frontier] == [parameters - k * per_group for k in range(4)]
    work = result.work
    assert work[Stage.FRONTIER] > 3 * work.heldout_pass and Stage.FRONTIER not in ph.pruner.BEFORE_TUNING
    budget = ph.PruneConfig(selection=ph.SelectionConfig(num_heads=2, depths="1/3"))
    shallower = ph.prune_model(_silent_llama()[0], _labelled("llama"), budget, progress=False)
    assert shallower.heads_removed == 2 and all(set(h) <= set(silent[n]) for n, h in shallower.plan.items())


@pytest.mark.parametrize("name", ["bert", "llama", "gpt2"])
def test_prune_model_removes_exactly_the_budget_and_reports_its_decisions(name):
    model = tm.build(name)
    result = ph.prune_model(
        model, tm.batches(name), ph.PruneConfig(selection=ph.SelectionConfig(num_heads=4)), progress=False
    )
    assert result.heads_removed == result.asked == 4
    assert sum(l.num_heads for l in ph.find_attention(model)) == 12 - 4
    selection = next(e for e in result.recovery if e["step"] == "selection")
    assert {"ranked", "ranked + reconstruction", "fluctuation + reconstruction", "OBS + reconstruction"} <= set(
        selection["tried"]
    )
    assert selection["kept"] in selection["tried"]
    # never worse on held-out data than the plain selection it started from
    assert result.heldout["final"] <= result.heldout["plain"] + 1e-12
    assert result.heldout["examples"] == 20 // 5  # every fifth calibration example (no written text by default)
    assert set(result.timings) >= {"scoring", "selection"}


def test_prune_model_leaves_the_callers_random_state_as_it_was():
    """Scoring, the written text and tuning draw from their own seeded generators, never the process's."""
    model, data = tm.build("llama"), tm.batches("llama")  # the tiny model's build seeds torch
    with tm.random_state_kept():
        ph.prune_model(model, data, ph.PruneConfig(ph.SelectionConfig(num_heads=4)), progress=False)


def test_prune_model_result_is_the_gated_state_it_measured():
    """The held-out value recorded for the kept state is what the folded, pruned model gives."""
    model = tm.build("bert")
    original = copy.deepcopy(model)
    data = tm.batches("bert", n=5)
    result = ph.prune_model(model, data, ph.PruneConfig(selection=ph.SelectionConfig(num_heads=5)), progress=False)
    _, heldout = split_holdout([{k: v for k, v in b.items() if k != "labels"} for b in data], 0.2)
    measured = kl(model, original, heldout) / sum(b["input_ids"].shape[0] for b in heldout)
    assert measured == pytest.approx(result.heldout["final"], rel=1e-4, abs=1e-7)


@pytest.mark.slow
def test_each_candidate_is_measured_as_if_it_were_tried_alone(monkeypatch):
    """A candidate's reconstruction is fitted to the unpruned weights, not to the one tried before it."""
    from prune_heads.pruner import flow as pruner

    config = ph.PruneConfig(selection=ph.SelectionConfig(num_heads=4), recovery=ph.RecoveryConfig(epochs=0))
    seen = {}

    def candidates(*args, **kwargs):
        plans, notes, work = real(*args, **kwargs)
        seen.update(plans)
        return dict(seen), notes, work

    real = pruner.candidate_plans
    monkeypatch.setattr(pruner, "candidate_plans", candidates)
    tried = next(e for e in ph.prune_model(tm.build("llama"), tm.batches("llama"), config, False).recovery)["tried"]
    assert len(seen) >= 3
    for name, plan in seen.items():
        monkeypatch.setattr(pruner, "candidate_plans", lambda *a, plan=plan, **k: ({"ranked": plan}, [], 0.0))
        alone = ph.prune_model(tm.build("llama"), tm.batches("llama"), config, False).recovery[0]["tried"]
        assert alone["ranked + reconstruction"] == pytest.approx(tried[f"{name} + reconstruction"], rel=1e-9)


def test_embedding_models_decide_on_neighbour_divergence_and_cosine():
    """For a model without logits the held-out value is 1 - cosine plus the divergence of each example's
    neighbour distribution among the held-out ones; the recorded value is what the pruned model gives."""
    model = tm.build("xlm-roberta")
    original = copy.deepcopy(model)
    data = tm.batches("xlm-roberta", n=10, labels=False)
    result = ph.prune_model(model, data, ph.PruneConfig(selection=ph.SelectionConfig(num_heads=6)), progress=False)
    _, heldout = split_holdout(data, 0.2)
    objective = Objective(original)
    with torch.no_grad():
        cosine = torch.cat(
            [objective.divergence(model(**b), b, objective.embedding(original(**b), b)) for b in heldout]
        ).double()
        pruned = torch.cat([objective.embedding(model(**b), b) for b in heldout])
        unpruned = torch.cat([objective.embedding(original(**b), b) for b in heldout])
    ranking = neighbour_divergence(unpruned, pruned)
    assert len(ranking) == 8 and ranking.mean() > cosine.mean()  # the case exercises the ranking term
    assert float((cosine + ranking).mean()) == pytest.approx(result.heldout["final"], rel=1e-4, abs=1e-7)


def test_prune_model_makes_no_copy_of_the_model(monkeypatch):
    """Only single attention layers are copied (the probe proves the removal on them, one at a time)."""
    original = copy.deepcopy
    model = tm.build("llama")
    largest = max(sum(p.numel() for p in layer.module.parameters()) for layer in ph.find_attention(model))

    copied = []

    def refuse(value, *args, **kwargs):
        if isinstance(value, torch.nn.Module):
            copied.append(type(value).__name__)
            assert sum(p.numel() for p in value.parameters()) <= largest, "prune_model copied more than a layer"
        return original(value, *args, **kwargs)

    monkeypatch.setattr(copy, "deepcopy", refuse)
    with pytest.raises(AssertionError, match="copied more than a layer"):
        copy.deepcopy(model)  # the guard catches a copy of the model
    copied.clear()
    ph.prune_model(model, tm.batches("llama"), progress=False)
    assert copied and set(copied) == {"LlamaAttention"}  # the probe's copies went through the guard


@pytest.mark.slow
def test_tuning_runs_without_what_only_the_choice_needed(monkeypatch):
    """Scoring's and tuning's backward passes are the flow's memory peaks (benchmarks/research-log.md, "Time and
    memory"): the Gram matrices are recorded after scoring, and they, the candidates' refits and the output
    projections' originals are gone before tuning starts (the plan is proven exact first, so nothing needs the
    originals back)."""
    import gc

    from prune_heads.pruner import flow as pruner
    from prune_heads.recovery.reconstruction import Refit
    from prune_heads.scoring.recording import Moments

    seen = {}

    def inspecting(forward, *args, **kwargs):
        gc.collect()
        seen["statistics and refits"] = sum(isinstance(o, (Moments, Refit)) for o in gc.get_objects())
        gated = [o for o in gc.get_objects() if isinstance(o, GatedModel)]
        seen["gated models"], seen["originals"] = len(gated), sum(len(g._originals) for g in gated)
        return tune(forward, *args, **kwargs)

    def scoring(*args, **kwargs):  # the scoring pass's own peak: the Gram matrices come in a pass of their own
        gc.collect()
        seen["statistics while scoring"] = sum(isinstance(o, Moments) for o in gc.get_objects())
        return score_heads(*args, **kwargs)

    monkeypatch.setattr(pruner, "tune", inspecting)
    monkeypatch.setattr(pruner, "score_heads", scoring)
    result = ph.prune_model(tm.build("llama"), tm.batches("llama", n=10), progress=False)
    selection = next(e for e in result.recovery if e["step"] == "selection")
    assert selection["kept"].endswith("+ reconstruction")  # refits were made and written into the weights
    assert seen == {"statistics while scoring": 0, "statistics and refits": 0, "gated models": 1, "originals": 0}
    assert result.work[Stage.RECORDING] == result.work.calibration_pass / 2  # one forward pass, counted


def test_budget_is_refused_before_any_scoring(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("scored before checking the budget")

    monkeypatch.setattr("prune_heads.pruner.flow.score_heads", boom)
    llama = tm.build("llama")  # 3 layers x 4 heads in KV groups of 2
    with pytest.raises(ph.PlanError, match=r"exactly 1 heads.* 0 heads .* or 2 heads"):
        ph.prune_model(llama, tm.batches("llama"), ph.PruneConfig(selection=ph.SelectionConfig(num_heads=1)))
    with pytest.raises(ph.PlanError, match="exactly"):
        ph.prune_model(llama, tm.batches("llama"), ph.PruneConfig(selection=ph.SelectionConfig(sparsity=0.1)))


def test_round_takes_the_nearest_reachable_budget_and_says_so():
    llama = tm.build("llama")
    config = ph.PruneConfig(selection=ph.SelectionConfig(num_heads=3, round="down"))
    result = ph.prune_model(llama, tm.batches("llama"), config, progress=False)
    assert (result.asked, result.heads_removed) == (3, 2)


def test_layer_granularity_drops_attention_blocks_and_their_kv_cache():
    llama = tm.build("llama")
    config = ph.PruneConfig(selection=ph.SelectionConfig(num_heads=4, granularity="layer"))
    result = ph.prune_model(llama, tm.batches("llama"), config, progress=False)
    assert [len(h) for h in result.plan.values()] == [4]
    assert sorted(l.num_heads for l in ph.find_attention(llama)) == [0, 4, 4]
    out = llama.generate(**tm.make_inputs("llama"), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    assert sorted(layer.keys.shape[1] for layer in cache.layers) == [0, 2, 2]  # KV heads per layer


def test_bias_compensation_adds_a_recorded_bias_that_reloads(tmp_path):
    llama = tm.build("llama")  # no output-projection bias
    config = ph.PruneConfig(
        selection=ph.SelectionConfig(num_heads=4),
        recovery=ph.RecoveryConfig(holdout=0, rearrange=False, gate_tuning=False, bias_tuning=False),
    )
    ph.prune_model(llama, tm.batches("llama"), config, progress=False)
    pruned = [l for l in ph.find_attention(llama) if l.num_heads < 4]
    assert pruned and all(l.module.o_proj.bias is not None and l.module.o_proj.bias.abs().sum() > 0 for l in pruned)
    ph.save_pruned(llama, tmp_path / "m")
    loaded = ph.load_pruned(tmp_path / "m", attn_implementation="eager")
    inputs = tm.make_inputs("llama")
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, llama(**inputs).logits)


def test_flap_bias_compensation_restores_the_removed_heads_mean_output():
    model = tm.build("bert")
    data = [{k: v for k, v in b.items() if k != "labels"} for b in tm.batches("bert")]
    layers = ph.find_attention(model)
    from prune_heads.scoring.recording import record

    recorder = record(model, data, Objective(model))
    plan = {layers[0].name: [1, 3]}
    o_proj = layers[0].module.get_submodule(layers[0].spec.o)
    outputs = []
    with GatedModel(model, layers) as gated, torch.no_grad():
        handle = o_proj.register_forward_hook(lambda m, a, out: outputs.append(out.detach()))  # after the bias
        for biases in (None, gated.compensation(plan, recorder.means())):
            gated.use({} if biases is None else plan, biases)
            for b in data:
                gated(b)
    handle.remove()
    rows = [o[b["attention_mask"].bool()] for o, b in zip(outputs, data * 2)]
    full, compensated = torch.cat(rows[: len(data)]).mean(0), torch.cat(rows[len(data) :]).mean(0)
    torch.testing.assert_close(compensated, full, rtol=0, atol=1e-5)


def test_tuning_the_gated_model_equals_tuning_a_pruned_copy():
    reference = tm.build("bert")
    plan = {"bert.encoder.layer.0.attention": [0, 1], "bert.encoder.layer.2.attention": [3]}
    data = [{k: v for k, v in b.items() if k != "labels"} for b in tm.batches("bert", n=3)]
    pruned = copy.deepcopy(reference)
    ph.prune(pruned, plan)
    ph.tune_gates(pruned, reference, data, epochs=3, lr=0.05, seed=1, bias_lr=0.01, average=0.9)

    model = copy.deepcopy(reference)
    objective = Objective(model)
    with torch.no_grad():
        targets = [objective.reference(model(**b), b) for b in data]
    gated = GatedModel(model, ph.find_attention(model))
    with gated:
        gated.use(plan)
        for tensor in gated.scales + gated.biases:
            tensor.requires_grad_(True)
        model.requires_grad_(False)
        tune(
            gated,
            [{"params": gated.scales, "lr": 0.05}, {"params": gated.biases, "lr": 0.01}],
            data,
            targets,
            objective,
            Schedule(3, seed=1, average=0.9),
        )
    gated.fold(plan)
    inputs = tm.make_inputs("bert", seed=9)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, pruned(**inputs).logits, rtol=0, atol=1e-5)


def _scalar_problem():
    """A one-parameter model whose two-class logits are (0, scale), tuned towards logits (0, 2)."""
    scale = torch.ones(1, requires_grad=True)

    def forward(batch):
        return type("Out", (), {"logits": (scale * batch["x"]).unsqueeze(0)})()

    target = [torch.log_softmax(torch.tensor([[0.0, 2.0]]), -1)]
    return scale, forward, Objective(torch.nn.Linear(1, 1)), [{"x": torch.tensor([0.0, 1.0])}], target


@pytest.mark.parametrize(
    "steps, name",
    [
        ({"projection_tuning": False}, "gate and bias tuning"),
        ({"gate_tuning": False, "bias_tuning": False}, "projection tuning"),
    ],
)
def test_each_tuning_step_switches_alone_and_is_named_in_the_report(steps, name):
    model = tm.build("bert")
    before = {l.name: l.module.output.dense.weight.clone() for l in ph.find_attention(model)}
    config = ph.PruneConfig(selection=ph.SelectionConfig(num_heads=1), recovery=ph.RecoveryConfig(holdout=0, **steps))
    result = ph.prune_model(model, tm.batches("bert", n=2), config, progress=False)
    assert [e["step"] for e in result.recovery] == ["selection", name]
    layers = {l.name: l for l in ph.find_attention(model)}
    untouched = [n for n in before if not result.plan.get(n)]  # no refit there: only tuning changes the weight
    assert untouched
    for n in untouched:
        weight = layers[n].module.output.dense.weight
        column_scaled = torch.allclose(weight, before[n] * (weight / before[n])[:1], atol=1e-6)
        assert column_scaled != steps.get("projection_tuning", True)  # a gate scales columns, an update does not


def test_tuning_stops_when_the_held_out_check_stops_improving():
    scale, forward, objective, data, target = _scalar_problem()
    checks = iter([1.0, 0.5, 0.7, 0.8, 0.1])  # improves once, then twice not: stop before the last value
    history, steps, *_ = tune(
        forward, [{"params": [scale], "lr": 0.1}], data, target, objective, Schedule(10), check=lambda: next(checks)
    )
    assert history == [1.0, 0.5, 0.7, 0.8] and steps == 3
    # out of budget: the first step always runs, none after it
    budget = WorkLimit(0.0, Pricer(1.0), check=0.0)
    assert (
        tune(forward, [{"params": [scale], "lr": 0.1}], data * 4, target * 4, objective, Schedule(10), budget=budget)[1]
        == 1
    )
    assert budget.spent == Pricer(1.0).forward_backward(data) == 4  # one step on 2 positions, forward and backward


def test_tuning_budget_counts_work_and_spends_no_more_than_its_limit():
    scale, forward, objective, data, target = _scalar_problem()
    checks = iter([1.0 / k for k in range(1, 100)])  # always improving: only the budget stops it
    budget = WorkLimit(30.0, Pricer(1.0), check=2.0)  # a step costs 4, a check 2 (twice with the average)
    history, steps, _, spent = tune(
        forward,
        [{"params": [scale], "lr": 0.1}],
        data * 3,
        target * 3,
        objective,
        Schedule(10, average=0.5),
        check=lambda: next(checks),
        budget=budget,
    )
    # 2 (first check) + 3 steps of 4 + 2 checks of 2 = 18; then 3 more steps would pass 30 with the check
    assert (steps, spent, len(history)) == (5, 2 + 5 * 4 + 2 * 4, 3) and spent <= 30.0


def _slow_clock(monkeypatch):
    """Every clock the process can read jumps an hour per call: a limit that read one would bind at once."""
    import time

    for name in ("perf_counter", "monotonic", "time", "process_time"):
        real = getattr(time, name)
        monkeypatch.setattr(time, name, lambda real=real, jumps=iter(range(10**9)): real() + 3600.0 * next(jumps))  # noqa: B008 (one counter per clock)


@pytest.mark.slow
def test_a_budget_that_binds_gives_the_same_weights_when_the_clock_is_slow(monkeypatch):
    """No limit of the pruning flow reads a clock: the budget is counted work, so a slow or busy machine
    tunes exactly as far as an idle one, and writes the same weights bit for bit."""
    config = ph.PruneConfig(
        selection=ph.SelectionConfig(num_heads=4), recovery=ph.RecoveryConfig(min_tuning_flops=0.0, tuning_budget=3.0)
    )
    data = tm.batches("llama", n=10, labels=False)
    runs = []
    for slow in (False, True):
        if slow:
            _slow_clock(monkeypatch)
        model = tm.build("llama")
        runs.append((model, ph.prune_model(model, data, config, progress=False)))
    (fast, first), (slow, second) = runs
    tuning = next(e for e in first.recovery if "tuning" in e["step"])
    assert 0 < tuning["epochs_run"] < config.recovery.epochs  # the budget bound
    assert tuning["flops"] <= tuning["budget_flops"] == first.work.tuning_budget
    assert first.work == second.work and first.plan == second.plan
    assert [e.get("tried", e.get("heldout_by_epoch")) for e in first.recovery] == [
        e.get("tried", e.get("heldout_by_epoch")) for e in second.recovery
    ]
    for (name, a), b in zip(fast.state_dict().items(), slow.state_dict().values()):
        assert torch.equal(a, b), name


def test_tuning_keeps_the_moving_average_or_the_last_step_whichever_checks_lower(monkeypatch):
    scale, forward, objective, data, target = _scalar_problem()
    iterates, adam_step = [], torch.optim.Adam.step

    def recording_step(self, *args, **kwargs):
        out = adam_step(self, *args, **kwargs)
        iterates.append(scale.detach().item())
        return out

    monkeypatch.setattr(torch.optim.Adam, "step", recording_step)
    group = [{"params": [scale], "lr": 0.1}]
    tune(forward, group, data * 3, target * 3, objective, Schedule(1, average=0.8))  # no check: the average is left
    weights = [0.2 * 0.8 ** (len(iterates) - 1 - k) for k in range(len(iterates))]
    mean = sum(w * x for w, x in zip(weights, iterates)) / sum(weights)  # the bias-corrected moving average
    last = iterates[-1]
    assert len(iterates) == 3 and abs(mean - last) > 1e-3 and scale.detach().item() == pytest.approx(mean, rel=1e-6)
    for wanted, is_average in ((mean, True), (last, False)):  # the same steps again; the check prefers one value
        scale.data.fill_(1.0)
        iterates.clear()
        history, steps, averaged, _ = tune(
            forward,
            [{"params": [scale], "lr": 0.1}],
            data * 3,
            target * 3,
            objective,
            Schedule(1, average=0.8),
            check=lambda: abs(scale.detach().item() - wanted),  # noqa: B023 (called within this iteration)
        )
        assert steps == 3 and averaged is is_average and history[-1] == pytest.approx(0.0, abs=1e-6)
        assert scale.detach().item() == pytest.approx(wanted, rel=1e-6)


def test_recovery_config_refuses_values_out_of_range():
    for bad in (
        {"holdout": 1.0},
        {"average": -0.1},
        {"average": 1.0},
        {"epochs": -1},
        {"projection_rank": 0},
        {"search_rounds": -1},
        {"search_examples": 0},
    ):
        with pytest.raises(ph.config.ConfigError, match=f"recovery.{next(iter(bad))}"):
            ph.RecoveryConfig(**bad)


def test_split_holdout_takes_every_fifth_example_across_batches():
    data = [{"input_ids": torch.arange(i * 4, i * 4 + 4)[:, None]} for i in range(5)]
    calib, held = split_holdout(data, 0.2)
    assert torch.cat([b["input_ids"] for b in held]).flatten().tolist() == [4, 9, 14, 19]
    assert sum(len(b["input_ids"]) for b in calib) == 16
    assert split_holdout(data, 0.0) == (data, [])
    single = [{"input_ids": torch.zeros(1, 3)}]
    assert split_holdout(single, 0.2) == (single, [])


def test_label_free_objective_and_iterative_steps():
    model = tm.build("bert")
    config = ph.PruneConfig(
        selection=ph.SelectionConfig(sparsity=0.25), scoring=ph.ScoringConfig(objective="label-free")
    )
    assert ph.prune_model(model, tm.batches("bert"), config, progress=False).heads_removed == 3
    iterative = ph.PruneConfig(
        selection=ph.SelectionConfig(sparsity=0.5), scoring=ph.ScoringConfig(steps=2), recovery=ph.RecoveryConfig.off()
    )
    with pytest.raises(ph.config.ConfigError, match="ph.prune_iteratively's path"):
        ph.prune_model(tm.build("bert"), tm.batches("bert"), iterative, progress=False)
    result = ph.prune_iteratively(tm.build("bert"), tm.batches("bert"), 0.5, steps=2, progress=False)
    assert result.plan and sum(map(len, result.plan.values())) == 6 and len(result.history) == 3


@pytest.mark.parametrize("method", ["fisher", "random"])
def test_no_recovery_records_nothing_and_equals_plain_prune(monkeypatch, method):
    """Without recovery the unpruned model's statistics and outputs are not recorded (no hooks, no extra
    pass), and the result is the plain selection pruned as it is."""

    def boom(*args, **kwargs):
        raise AssertionError("recorded without recovery")

    monkeypatch.setattr("prune_heads.pruner.flow.Recorder.__init__", boom)
    monkeypatch.setattr("prune_heads.pruner.flow.record", boom)
    model, plain = tm.build("bert"), tm.build("bert")
    config = ph.PruneConfig(
        selection=ph.SelectionConfig(num_heads=5),
        scoring=ph.ScoringConfig(method=method),
        recovery=ph.RecoveryConfig.off(),
    )
    result = ph.prune_model(model, tm.batches("bert"), config, progress=False)
    scores = ph.score_heads(plain, tm.batches("bert"), method=method, progress=False)
    assert result.plan == ph.select_heads(scores, num_heads=5)
    ph.prune(plain, result.plan)
    inputs = tm.make_inputs("bert")
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, plain(**inputs).logits)


def test_every_long_stage_shows_a_bar_on_a_terminal_and_none_without_progress(monkeypatch, capsys):
    """Scoring, recording, each search round, the candidates and tuning each show a bar (tqdm's time estimate
    with it) where bars may show; `progress=False` (the CLI's --quiet, a pipe) shows none."""
    monkeypatch.setattr("prune_heads.runtime.progress.bars_wanted", lambda: True)
    config = ph.PruneConfig(selection=ph.SelectionConfig(num_heads=4), recovery=ph.RecoveryConfig(epochs=1))
    ph.prune_model(tm.build("llama"), tm.batches("llama"), config, progress=True)
    shown = capsys.readouterr().err
    for stage in ("scoring heads", "recording", "search round 1/2", "search round 2/2", "candidates", "tuning"):
        assert stage in shown, stage
    ph.prune_model(tm.build("llama"), tm.batches("llama"), config, progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_prunes_to_finite_weights_the_same_on_a_rerun(dtype):
    """The default path on a model held in bfloat16 or float16 (statistics and solves in float64, gates in
    float32): the weights stay in the model's dtype, finite, and a second run gives them bit for bit."""
    data = tm.batches("llama", labels=False)
    config = ph.PruneConfig(selection=ph.SelectionConfig(num_heads=4))
    runs = []
    for _ in range(2):
        model = tm.build("llama", dtype=dtype)
        runs.append((model, ph.prune_model(model, data, config, progress=False)))
    (first, a), (second, b) = runs
    assert a.plan == b.plan and sum(len(h) for h in a.plan.values()) == 4
    assert all(p.dtype == dtype and torch.isfinite(p).all() for p in first.parameters())
    assert all(torch.equal(p, q) for p, q in zip(first.state_dict().values(), second.state_dict().values()))


@pytest.mark.slow
def test_under_a_kv_cache_budget_kv_heads_are_shared_where_that_measures_better(tmp_path):
    """A KV-cache budget of half the cache on the planted Llama: the flow tries keeping the emptied groups' query
    heads on the KV head each layer keeps, measures that better than any removal, and the model it writes is
    the state it measured (its held-out value), shares in every layer, keeps every query head, holds the
    budget's cache and saves, loads and generates; its written plan, given whole, shares the same heads and
    measures no worse. Without `kv_sharing` the same budget removes whole groups."""
    model, data = tm.planted_llama(), tm.batches("llama")
    original = copy.deepcopy(model)
    config = ph.PruneConfig(ph.SelectionConfig(kv_cache="6KiB@64"))
    result = ph.prune_model(model, data, config, progress=False)
    selection = next(e for e in result.recovery if e["step"] == "selection")
    assert selection["kept"] == "search, shared + reconstruction"
    removals = [v for k, v in selection["tried"].items() if "shared" not in k]
    assert min(removals) > 100 * selection["tried"][selection["kept"]]
    assert result.plan == {} and len(result.sharing) == 3 == len(selection["shared_kv_heads"])
    assert [(l.num_heads, l.num_kv_heads) for l in ph.find_attention(model)] == [(4, 1)] * 3
    assert ph.kv_cache_size(model, 64) == 6 * 1024
    _, heldout = split_holdout([{k: v for k, v in b.items() if k != "labels"} for b in data], 0.2)
    measured = kl(model, original, heldout) / sum(b["input_ids"].shape[0] for b in heldout)
    assert measured == pytest.approx(result.heldout["final"], rel=1e-4, abs=1e-7)
    ph.save_pruned(model, tmp_path / "shared")
    loaded, inputs = ph.load_pruned(tmp_path / "shared"), tm.make_inputs("llama")
    with torch.no_grad():  # at the tokens attended (padding's rows differ between attention kernels)
        kept = inputs["attention_mask"].bool()
        torch.testing.assert_close(loaded(**inputs).logits[kept], model(**inputs).logits[kept])
    assert loaded.generate(inputs["input_ids"][1:], max_new_tokens=3, do_sample=False).shape[-1] == 10
    again = ph.prune_model(tm.planted_llama(), data, ph.PruneConfig(), progress=False, plan=result.written_plan)
    assert again.sharing == result.sharing and again.plan == {}
    assert again.heldout["final"] <= result.heldout["final"] + 1e-7  # the same sharing, also tried unrefitted
    removal = ph.PruneConfig(ph.SelectionConfig(kv_cache="6KiB@64"), recovery=ph.RecoveryConfig(kv_sharing=False))
    removed = ph.prune_model(tm.planted_llama(), data, removal, progress=False)
    assert removed.heads_removed == 6 and removed.sharing == {}


@pytest.mark.slow
def test_a_frontier_under_a_kv_cache_budget_measures_each_depth_with_kv_heads_shared_too():
    """On the planted Llama, a frontier under a KV-cache budget measures half the cache also with the emptied
    groups' query heads kept on the KV head each layer keeps: no change where removing them changes the
    perplexity, at the same cache, with the parameters the shared model has; its plan, given whole, writes that
    model (the unpruned depth has none)."""
    config = ph.PruneConfig(ph.SelectionConfig(kv_cache="6KiB@64", depths="1/3,1/2"))
    result = ph.prune_model(tm.planted_llama(), _labelled("llama"), config, progress=False)
    assert [d.shared is None for d in result.frontier] == [True, False, False]
    half = result.frontier[-1]
    shared = half.shared
    assert shared.heads == 0 and len(shared.sharing) == 3 and shared.plan_file == "frontier/plan-1-2-shared.json"
    assert shared.kv_cache == half.kv_cache and (shared.units, shared.share) == (half.units, half.share)
    assert abs(shared.perplexity_change) < 1e-3 < abs(half.perplexity_change)  # the planted copies: no change
    model = tm.planted_llama()
    given = ph.prune_model(model, _labelled("llama"), ph.PruneConfig(), progress=False, plan=shared.written_plan)
    assert given.sharing == shared.sharing and sum(p.numel() for p in model.parameters()) == shared.parameters


def _planted_text(n: int = 10) -> list[dict]:
    """Text the planted Llama writes itself (greedy, from two tokens of each tiny batch): any head it loses
    raises its loss on it."""
    model = tm.planted_llama()
    found = []
    for batch in tm.batches("llama", n=n):
        start = batch["input_ids"][:, :2]
        with torch.no_grad():
            ids = model.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=10, do_sample=False)
        found.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return found


@pytest.mark.slow
def test_a_loss_bound_goes_deeper_where_sharing_kv_heads_keeps_the_loss_within_it():
    """A known answer: on the planted Llama's own text, removing any KV group raises the loss by over 1%, and
    keeping its query heads on the layer's other KV head (a copy) does not. Under a bound of 0.1%, the loss bound
    shares a KV head in every layer (the deepest prefix, measured shared) and removes no head; the candidates
    reuse the sharing's statistics recorded there (no recording beyond removal's); without `kv_sharing` it
    removes nothing at all."""
    config, text = ph.PruneConfig(ph.SelectionConfig(max_loss=0.1)), _planted_text()
    model = tm.planted_llama()
    result = ph.prune_model(model, text, config, progress=False)
    depth = result.heldout["max_loss"]
    assert depth["heads"] == 6 and len(depth["shared_kv_heads"]) == 3 and depth["rises"][0][1] <= 1e-3
    assert result.plan == {} and result.sharing == depth["shared_kv_heads"]
    assert ph.kv_cache_size(model, 64) == 6 * 1024  # half the cache: one KV head a layer
    removal = dataclasses.replace(config, recovery=ph.RecoveryConfig(kv_sharing=False))
    removed = ph.prune_model(tm.planted_llama(), text, removal, progress=False)
    assert removed.heads_removed == 0 and min(rise for _, rise in removed.heldout["max_loss"]["rises"]) > 1e-2
    assert "shared_kv_heads" not in removed.heldout["max_loss"]
    assert result.work[Stage.RECORDING] == removed.work[Stage.RECORDING]


def test_a_kv_cache_budget_on_a_model_that_cannot_share_removes_and_says_why_in_one_note():
    model = tm.build("gpt2")  # one KV head per query head: no grouped-query layout to share into
    budget = f"{ph.kv_cache_size(model, 64) // 2}B@64"
    result = ph.prune_model(model, tm.batches("gpt2"), ph.PruneConfig(ph.SelectionConfig(kv_cache=budget)), False)
    notes = next(e for e in result.recovery if e["step"] == "notes")["notes"]
    assert [n for n in notes if "KV heads not shared" in n] == [
        "KV heads not shared: its family (gpt2) keeps no grouped-query layout"
    ]
    assert result.heads_removed == 6 and result.sharing == {}
