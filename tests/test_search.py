import re

import pytest
import tiny_models as tm
import torch

import prune_heads as ph
from prune_heads.config import SHARE
from prune_heads.recovery import search
from prune_heads.recovery.search import search_order, searched_scores
from prune_heads.runtime.ledger import Stage
from prune_heads.scoring.selection import HeadBudget, removal_units

# two layers of 6 query heads, 2 per KV head: groups (0, 1), (2, 3), (4, 5)
SCORES = tm.make_scores([[1.0] * 6, [1.0] * 6], group_sizes=[2, 2])
A, B, C = ("layers.0.attn", (0, 1)), ("layers.0.attn", (2, 3)), ("layers.1.attn", (0, 1))
ALONE = {A: 1.0, B: 2.0, C: 3.0}


def measured(plan: dict, changed: str, part: int = 0) -> torch.Tensor:
    """An additive cost of the units gone, except that B costs 10 more once A has gone (A stood in for it)."""
    gone = {(name, heads[i : i + 2]) for name, heads in plan.items() for i in range(0, len(heads), 2)}
    return torch.tensor([sum(ALONE.get(u, 5.0) for u in gone) + (10.0 if {A, B} <= gone else 0.0)])


def test_units_are_what_selection_removes_together():
    units = removal_units(SCORES, HeadBudget(num_heads=0, gqa="groups", min_heads_per_layer=1))
    assert units == {n: ([(0, 1), (2, 3), (4, 5)], 5) for n in ("layers.0.attn", "layers.1.attn")}
    assert removal_units(SCORES, HeadBudget(num_heads=0, gqa="even"))["layers.0.attn"][0] == [(0, 2, 4), (1, 3, 5)]
    assert list(removal_units(SCORES, HeadBudget(num_heads=0, ignore="layers.1"))) == ["layers.0.attn"]


def test_one_round_takes_the_cheapest_alone_and_more_rounds_measure_what_went_before():
    units = removal_units(SCORES, HeadBudget(num_heads=0))
    once, present = search_order(units, budget=4, rounds=1, cost=measured)
    assert once[:2] == [A, B] and present == [6]  # each cheap alone
    twice, present = search_order(units, budget=4, rounds=2, cost=measured)
    assert twice[:2] == [A, C] and present == [6 + 5]  # B measured again once A has gone: 13 > 4
    for order in (once, twice):  # every unit is ranked, once
        assert sorted(order) == sorted((n, u) for n, (us, _) in units.items() for u in us)


def test_a_layer_never_loses_more_than_its_room():
    units = {"layers.0.attn": ([(0, 1), (2, 3), (4, 5)], 2), "layers.1.attn": ([(0, 1), (2, 3), (4, 5)], 6)}
    order, _ = search_order(
        units, budget=4, rounds=1, cost=lambda plan, changed, part: torch.tensor([float(changed != "layers.0.attn")])
    )
    assert order[:2] == [A, C]


def test_a_screened_round_measures_only_the_cheapest_on_the_rest_and_takes_by_every_example():
    """The screen (part 0, one example: nothing is clear on it) puts A first and C last; on the rest (part 1) A
    is dear: every example decides. With a share of one unit the two cheapest on the screen race on the rest; C
    is never measured there."""
    screen = {A: 0.0, B: 1.0, C: 9.0}
    rest = {A: 9.0, B: 1.0, C: 0.0}
    calls = []

    def cost(plan: dict, changed: str, part: int) -> torch.Tensor:
        unit = next((n, tuple(h)) for n, h in plan.items() if n == changed)
        calls.append((unit, part))
        values = screen if part == 0 else rest
        return torch.tensor([values.get(unit, 20.0)] * (1 if part == 0 else 3))

    units = removal_units(SCORES, HeadBudget(num_heads=0))
    order, priced = search_order(units, budget=2, rounds=1, cost=cost, parts=2)
    assert order[0] == B  # A: (0 + 3 x 9) / 4 = 6.75 over every example; B 1.0
    assert {u for u, part in calls if part == 1} == {A, B} and priced == [6, 2]
    assert order[1:3] == [A, C]  # those measured on every example, then the screen's order


def _screened_cost(screen: dict, rest: dict, calls: list):
    """A cost of one unit gone: `screen[unit]` per example on part 0, `rest[unit]` on part 1 (20 elsewhere)."""

    def cost(plan: dict, changed: str, part: int) -> torch.Tensor:
        unit = next((n, tuple(h)) for n, h in plan.items() if n == changed)
        calls.append((unit, part))
        return torch.tensor((screen if part == 0 else rest).get(unit, [20.0] * (4 if part == 0 else 3)))

    return cost


@pytest.mark.parametrize("later", ["C stays cheaper", "B overtakes C"])
def test_a_screened_round_races_each_unit_only_until_it_is_clearly_in_or_out(later):
    """A round that takes two units races the four cheapest on the screen over two more parts. On the screen A
    lies clearly below B (the cheapest it would not take) and is taken without more measurements; D lies clearly
    above C (the cut) and drops out. B and C race on: where C stays cheaper it is clearly in after one more part
    and B clearly out; where B turns cheap neither is clear and both run the last part, B taken by its mean."""
    D = ("layers.1.attn", (2, 3))
    parts = [
        {A: [0.0] * 4, C: [1.0, 2.0, 1.0, 2.0], B: [2.0, 1.0, 2.0, 2.0], D: [20.0] * 4},
        {C: [1.0] * 3, B: [3.0] * 3} if later == "C stays cheaper" else {C: [3.0] * 3, B: [0.0] * 3},
        {C: [3.0] * 3, B: [0.0] * 3},
    ]
    calls: list = []

    def cost(plan: dict, changed: str, part: int) -> torch.Tensor:
        unit = next((n, tuple(h)) for n, h in plan.items() if n == changed)
        calls.append((unit, part))
        return torch.tensor(parts[part].get(unit, [20.0] * (4 if part == 0 else 3)))

    units = removal_units(SCORES, HeadBudget(num_heads=0))
    order, priced = search_order(units, budget=4, rounds=1, cost=cost, parts=3)
    raced = [[u for u, part in calls if part == p] for p in (1, 2)]
    if later == "C stays cheaper":
        assert raced == [[B, C], []] and order[:2] == [A, C] and priced == [6, 2, 0]
    else:
        assert raced == [[B, C], [B, C]] and order[:2] == [A, B] and priced == [6, 2, 2]


def test_a_unit_out_of_the_race_stays_out_though_the_cut_moves(monkeypatch):
    """With room for three units in the race, B's screen lies clearly above A's (the cut) on every example and
    B drops out; on the rest A turns dear, so C is taken, and B, never measured there, ranks after them."""
    monkeypatch.setattr(search, "MARGIN", 3.0)
    screen = {A: [0.0] * 4, C: [0.0, 1.0, 0.0, 1.0], B: [1.0] * 4}
    rest = {A: [9.0] * 3, C: [5.0] * 3, B: [0.0] * 3}
    calls: list = []
    units = removal_units(SCORES, HeadBudget(num_heads=0))
    order, priced = search_order(units, budget=2, rounds=1, cost=_screened_cost(screen, rest, calls), parts=2)
    assert [u for u, part in calls if part == 1] == [A, C]
    assert order[:3] == [C, A, B] and priced == [6, 2]


@pytest.mark.parametrize("noisy", [False, True])
def test_a_later_round_screens_only_the_units_its_earlier_screen_does_not_rule_out(noisy):
    """Round 1 screens all six units and takes A. Round 2 may measure two units on the rest, C and B the two
    cheapest on round 1's screen: D's round-1 screen lies clearly above B's (the dearest there of the two) and
    D is not screened again, unless it lies within noise of it; the units at 20 never are. The units round 2
    leaves unscreened are ranked after the rest by their round-1 screen."""
    D = ("layers.1.attn", (2, 3))
    screen = {A: [0.0] * 4, C: [0.0, 1.0, 0.0, 1.0], B: [1.0] * 4, D: [0.5, 2.0, 0.5, 2.0] if noisy else [3.0] * 4}
    calls: list = []
    measured = _screened_cost(screen, {}, calls)

    def cost(plan: dict, changed: str, part: int) -> torch.Tensor:  # the unit alone: its cost is the same after A
        heads = plan[changed][2:] if changed == A[0] and len(plan[changed]) > 2 else plan[changed]
        return measured({changed: heads}, changed, part)

    units = removal_units(SCORES, HeadBudget(num_heads=0))
    order, priced = search_order(units, budget=4, rounds=2, cost=cost, parts=2)
    again = [u for u, part in calls if part == 0][6:]
    assert sorted(again) == sorted([B, C, D] if noisy else [B, C]) and priced[0] == 6 + len(again)
    assert order[:4] == [A, C, B, D]  # C's screen is cheaper on the rest's 20s; D before the units at 20 either way


def test_a_unit_comes_within_reach_once_the_round_s_own_screen_moves_its_cheapest():
    """Round 2 first screens C, B and G (G's round-1 screen within noise of B's, the dearest of the two cheapest
    there). B got dear once A went, so G joins C among the round's two cheapest; D, clearly above B but not
    above G on round 1's screen, is screened in a second wave. The unit at 20 never is."""
    G, D = ("layers.1.attn", (2, 3)), ("layers.1.attn", (4, 5))
    screen = {A: [0.0] * 4, C: [0.0, 1.0, 0.0, 1.0], B: [1.0] * 4, G: [0.0, 3.0, 0.0, 3.0], D: [2.0, 2.5] * 2}
    calls: list = []
    measured = _screened_cost(screen, {}, calls)

    def cost(plan: dict, changed: str, part: int) -> torch.Tensor:
        if changed == A[0] and plan[changed] == (0, 1, 2, 3) and part == 0:  # B once A has gone
            calls.append((B, part))
            return torch.tensor([25.0] * 4)
        heads = plan[changed][2:] if changed == A[0] and len(plan[changed]) > 2 else plan[changed]
        return measured({changed: heads}, changed, part)

    units = removal_units(SCORES, HeadBudget(num_heads=0))
    search_order(units, budget=4, rounds=2, cost=cost, parts=2)
    again = [u for u, part in calls if part == 0][6:]
    assert again == [B, C, G, D]  # the first wave in the units' order, then D


def test_a_screened_round_with_no_unit_left_that_has_room_ends_the_search():
    units = {"layers.0.attn": ([(0, 1), (2, 3), (4, 5)], 2)}  # room for one unit: round 2 has none eligible
    order, priced = search_order(units, budget=4, rounds=2, cost=_screened_cost({}, {}, []), parts=2)
    assert len(order) == 3 and priced[0] == 3


def test_searched_scores_make_select_heads_take_the_searched_units():
    order, _ = search_order(removal_units(SCORES, HeadBudget(num_heads=0)), budget=4, rounds=2, cost=measured)
    plan = ph.select_heads(searched_scores(SCORES, order), num_heads=4)
    assert plan == {"layers.0.attn": [0, 1], "layers.1.attn": [0, 1]}


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_the_default_searches_where_outputs_are_per_token_and_counts_its_work(name):
    """A language model's default tries the searched plan; a classifier's (one output per example, where the
    search's plan never won) leaves it out, unless `search_rounds` asks for it."""

    def run(**recovery):
        config = ph.PruneConfig(ph.SelectionConfig(num_heads=4), recovery=ph.RecoveryConfig(**recovery))
        result = ph.prune_model(tm.build(name), tm.batches(name), config, progress=False)
        notes = next((e["notes"] for e in result.recovery if e["step"] == "notes"), [])
        return next(e["tried"] for e in result.recovery if e["step"] == "selection"), result.work, notes

    tried, work, notes = run()
    per_token = name == "llama"
    assert ("search + reconstruction" in tried) == per_token and (work[Stage.SEARCH] > 0) == per_token
    assert not any("search" in n for n in notes)  # by default a classifier's flow is the flow without it
    tried, work, _ = run(search_rounds=2)
    assert "search + reconstruction" in tried and work[Stage.SEARCH] > 0
    tried, work, notes = run(search_rounds=0)
    assert not any("search" in k for k in tried) and Stage.SEARCH not in work
    assert not any("search" in n for n in notes)


def test_a_tuning_budget_too_small_for_the_search_leaves_it_out_and_says_so():
    config = ph.PruneConfig(ph.SelectionConfig(num_heads=4), recovery=ph.RecoveryConfig(tuning_budget=0.5))
    result = ph.prune_model(tm.build("llama"), tm.batches("llama"), config, progress=False)
    notes = next(e["notes"] for e in result.recovery if e["step"] == "notes")
    assert any(n.startswith("search not tried: its work") for n in notes)
    assert result.work[Stage.SEARCH] == 0.0


def test_the_search_fits_in_what_the_tuning_budget_has_left_after_the_writing_and_the_recording():
    def run(budget: float) -> tuple[list[str], dict]:
        recovery = ph.RecoveryConfig(tuning_budget=budget, generated_share=SHARE)
        config = ph.PruneConfig(ph.SelectionConfig(num_heads=4), recovery=recovery)
        result = ph.prune_model(tm.build("llama"), tm.batches("llama"), config, progress=False)
        return next((e["notes"] for e in result.recovery if e["step"] == "notes"), []), result.work

    notes, work = run(0.5)
    pattern = r"search not tried: its work \(up to ([0-9.]+) calibration passes, more than the ([0-9.]+)"
    spent = (work[Stage.RECORDING] + work[Stage.GENERATION]) / work.calibration_pass  # before the search, in passes
    found = re.search(pattern, " ".join(notes))
    assert found and float(found.group(2)) == pytest.approx(max(0.5 - spent, 0.0), abs=0.05)
    bound = float(found.group(1))  # to a tenth
    notes, work = run(bound + spent / 2)  # the search alone would fit; after what was spent it does not
    assert spent / 2 > 0.05 and work[Stage.SEARCH] == 0.0 and any(n.startswith("search not tried") for n in notes)
    notes, work = run(bound + spent + 0.1)
    assert work[Stage.SEARCH] > 0 and not any(n.startswith("search not tried") for n in notes)


def _deep_llama():
    import transformers as T

    torch.manual_seed(0)
    config = T.LlamaConfig(**{**tm.COMMON, "num_hidden_layers": 6, "num_key_value_heads": 2})
    return T.LlamaForCausalLM(config).eval()


def _searched(monkeypatch, chain=True, changing=False, passes=False, **recovery):
    """The default flow's search on a 6-block Llama: its candidates' held-out values, the pruned weights, the
    search's counted work and the notes; `chain=False` measures every unit over the whole model, `changing`
    makes the last block change what it is given (so starting part-way is not exact), `passes` counts the
    search's passes alone (its refits, the same either way, left out)."""
    if not chain:
        monkeypatch.setattr(search, "block_chain", lambda model, layers: None)
    if passes:
        monkeypatch.setattr(search, "refit_flops", lambda layers, plan: 0.0)
    model = _deep_llama()
    if changing:
        last = model.model.layers[-1]
        plain = last.forward

        def forward(hidden_states, *args, **kwargs):
            out = plain(hidden_states, *args, **kwargs)
            if not torch.is_grad_enabled():  # after its use; in a backward pass autograd would refuse it
                hidden_states.mul_(1.5)
            return out

        last.forward = forward
    recovery = {"general": "off", **recovery}  # the search's own work, without the guard's text beside it
    config = ph.PruneConfig(ph.SelectionConfig(num_heads=8), recovery=ph.RecoveryConfig(epochs=1, **recovery))
    result = ph.prune_model(model, tm.batches("llama"), config, progress=False)
    monkeypatch.undo()
    tried = next(e["tried"] for e in result.recovery if e["step"] == "selection")
    notes = next((e["notes"] for e in result.recovery if e["step"] == "notes"), [])
    return tried, model.state_dict(), result.work[Stage.SEARCH] / result.work.calibration_pass, notes


def test_the_search_measures_from_each_unit_s_block_for_the_same_plan_and_less_work(monkeypatch):
    tried, weights, work, notes = _searched(monkeypatch, passes=True)
    whole_tried, whole_weights, whole_work, whole_notes = _searched(monkeypatch, chain=False, passes=True)
    assert tried == whole_tried and weights.keys() == whole_weights.keys()
    assert all(torch.equal(weights[k], whole_weights[k]) for k in weights)
    assert work < 0.8 * whole_work and not notes and not whole_notes
    tried, weights, _, _ = _searched(monkeypatch, general="weigh")  # the guard's text beside: the same again
    whole_tried, whole_weights, _, _ = _searched(monkeypatch, chain=False, general="weigh")
    assert tried == whole_tried and all(torch.equal(weights[k], whole_weights[k]) for k in weights)


def test_a_refit_asked_for_again_is_kept_not_fitted_again_and_gives_the_same_model(monkeypatch):
    """The search keeps the refits a later measurement asks for again (the racing units' and the state's);
    fitting each anew gives the same plan and weights, for more fits."""
    fits = []
    plain = ph.recovery.candidates.Trial.refit
    monkeypatch.setattr(ph.recovery.candidates.Trial, "refit", lambda self, *a: fits.append(a) or plain(self, *a))
    tried, weights, _, _ = _searched(monkeypatch)
    kept = len(fits)
    fits.clear()
    forgetful = search._Search._refits

    def anew(self, *args):
        self.fitted = {}
        return forgetful(self, *args)

    monkeypatch.setattr(ph.recovery.candidates.Trial, "refit", lambda self, *a: fits.append(a) or plain(self, *a))
    monkeypatch.setattr(search._Search, "_refits", anew)
    anew_tried, anew_weights, _, _ = _searched(monkeypatch)
    assert tried == anew_tried and all(torch.equal(weights[k], anew_weights[k]) for k in weights)
    assert kept < 0.6 * len(fits)


def test_a_model_where_starting_part_way_is_not_exact_is_searched_over_the_whole_model_and_says_so(monkeypatch):
    tried, _, work, notes = _searched(monkeypatch, changing=True)
    assert "search + reconstruction" in tried
    assert any(n.startswith("search: each forward pass over the whole model") for n in notes)


def test_the_screened_search_costs_less_than_the_full_schedule_which_stays_reachable(monkeypatch):
    """By default a round screens the units on the first of the search's batches and races the cheapest over
    the rest; `search_screen=False` measures every unit on every batch (the earlier schedule)."""
    tried, _, work, notes = _searched(monkeypatch)
    full_tried, _, full_work, full_notes = _searched(monkeypatch, search_screen=False)
    assert "search + reconstruction" in tried and "search + reconstruction" in full_tried
    assert work < 0.75 * full_work and not notes and not full_notes
