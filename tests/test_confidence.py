import math

import numpy as np
import pytest

from prune_heads.evaluation.confidence import (
    compare,
    describe,
    mcnemar,
    mean_of,
    paired_interval,
    perplexity_change,
    ratio_of,
)
from prune_heads.recovery.holdout import SequenceNLL


def test_mcnemar_is_the_exact_binomial_test_on_the_changed_examples():
    assert mcnemar([1, 0, 1], [1, 0, 1]) == 1.0  # nothing changed
    assert mcnemar([1] * 5, [0] * 5) == pytest.approx(2 / 2**5)  # five lost, none won
    before, after = [1] * 10 + [0] * 2 + [1] * 50, [0] * 10 + [1] * 2 + [1] * 50  # 10 lost, 2 won, 50 kept
    expected = 2 * sum(math.comb(12, k) for k in range(3)) / 2**12
    assert mcnemar(before, after) == pytest.approx(expected) and expected < 0.05


def test_paired_interval_is_seeded_and_cancels_what_both_share():
    rng = np.random.default_rng(0)
    shared = rng.normal(size=400)  # large differences between examples, the same for both models
    before, after = mean_of(shared), mean_of(shared + 0.01)
    low, high = paired_interval(before, after, seed=3)
    assert low == pytest.approx(0.01) and high == pytest.approx(0.01)  # paired: the shared spread cancels
    noisy = mean_of(shared + rng.normal(0, 0.5, 400))
    assert paired_interval(before, noisy, seed=1) == paired_interval(before, noisy, seed=1)  # reproducible
    assert paired_interval(before, noisy, seed=1) != paired_interval(before, noisy, seed=2)


def test_compare_says_within_noise_or_real():
    correct = np.array([1] * 80 + [0] * 20)
    same = compare(mean_of(correct), mean_of(correct), correct=(correct, correct))
    assert same["delta"] == 0 and same["noise"] and same["p_value"] == 1.0
    worse = correct.copy()
    worse[:30] = 0  # 30 of the 80 right answers lost
    change = compare(mean_of(correct), mean_of(worse), correct=(correct, worse))
    assert change["delta"] == pytest.approx(-0.3) and change["high"] < 0 and not change["noise"]
    assert "real, lower" in describe(change) and "McNemar p = " in describe(change)
    slight = correct.copy()
    slight[:1] = 0
    assert compare(mean_of(correct), mean_of(slight), correct=(correct, slight))["noise"]
    with pytest.raises(ValueError, match="same examples"):
        compare(mean_of(correct), mean_of(correct[:50]))


def test_perplexity_statistic_weighs_windows_by_their_tokens():
    sums, counts = [10.0, 30.0, 5.0], [5, 10, 5]
    statistic = ratio_of(sums, counts, math.exp)
    assert statistic.value() == pytest.approx(math.exp(45 / 20))
    assert statistic(np.array([1, 1])) == pytest.approx(math.exp(3.0))


def test_a_perplexity_change_and_its_paired_interval():
    """Every token 0.1 nats worse: the change is exp(0.1) - 1 and, paired, the interval is that point; with
    noise the interval is around the change."""
    before = SequenceNLL(np.array([10.0, 20.0, 5.0]), np.array([10, 20, 5]))
    after = SequenceNLL(before.nll + 0.1 * before.tokens, before.tokens)
    change, (low, high) = perplexity_change(before, after)
    assert change == pytest.approx(math.expm1(0.1)) and low == pytest.approx(change) and high == pytest.approx(change)
    noisy = SequenceNLL(after.nll + np.array([1.0, -1.0, 0.5]), before.tokens)
    change, (low, high) = perplexity_change(before, noisy)
    assert low < change < high and change == pytest.approx(math.expm1(0.1 + 0.5 / 35))
