import pytest

from prune_heads.runtime.ledger import BEFORE_TUNING, Stage, Tally


def test_a_ledger_counts_each_stage_under_its_own_member_and_adds_up():
    tally = Tally(calibration_pass=10.0, heldout_pass=2.0)
    tally.add(Stage.SEARCH, 30.0)
    tally.add(Stage.DEPTH, 1.0)
    tally.add(Stage.DEPTH, 2.0)
    tally.add(Stage.TUNING, 5.0)
    assert tally.spent(BEFORE_TUNING) == 33.0 and Stage.TUNING not in BEFORE_TUNING
    ledger = tally.ledger(tuning_budget=40.0)
    tally.add(Stage.FRONTIER, 7.0)  # closed: what is added later does not show
    assert ledger[Stage.DEPTH] == 3.0 and ledger[Stage.FRONTIER] == 0.0 and Stage.FRONTIER not in ledger
    assert ledger.total == 38.0 and ledger.passes([Stage.SEARCH]) == 3.0
    assert list(ledger.stages) == [Stage.SEARCH, Stage.DEPTH, Stage.TUNING]  # the flow's order
    assert ledger.as_dict() == {
        "calibration_pass": 10.0,
        "heldout_pass": 2.0,
        "search": 30.0,
        "depth": 3.0,
        "tuning": 5.0,
        "total": 38.0,
        "tuning_budget": 40.0,
    }
    assert "tuning_budget" not in Tally(1.0, 1.0).ledger().as_dict()
    with pytest.raises(ValueError):
        ledger["serach"]  # a typo is an error, never a silent 0
    with pytest.raises(TypeError):
        ledger.stages[Stage.SEARCH] = 0.0  # closed for good
