"""Which before/after differences are real: paired bootstrap intervals over examples and McNemar's exact test.

Every metric measured on the same examples before and after pruning is a `Statistic`: a function of a set
of example indices. The paired bootstrap draws the same resampled indices for both models, so the interval
is that of the difference itself (what the examples share cancels out). It is seeded, so a report is
reproducible. For accuracy, McNemar's exact test on the examples whose correctness changed adds a p-value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..recovery.holdout import SequenceNLL

RESAMPLES = 1000
LEVEL = 0.95


@dataclass(frozen=True)
class Statistic:
    """A metric as a function of example indices (repeats allowed) over `examples` examples."""

    of: Callable[[np.ndarray], float]
    examples: int

    def __call__(self, index: np.ndarray) -> float:
        return self.of(index)

    def value(self) -> float:
        """The metric on all the examples."""
        return self.of(np.arange(self.examples))


def mean_of(values) -> Statistic:
    """The mean of per-example values (accuracy from 0/1 correctness, mean cosine, ...)."""
    values = np.asarray(values, dtype=np.float64)
    return Statistic(lambda index: float(values[index].mean()), len(values))


def min_of(values) -> Statistic:
    """The smallest per-example value (the worst cosine)."""
    values = np.asarray(values, dtype=np.float64)
    return Statistic(lambda index: float(values[index].min()), len(values))


def ratio_of(numerators, denominators, transform: Callable[[float], float] = float) -> Statistic:
    """`transform(sum of numerators / sum of denominators)` over the examples: perplexity from each window's
    summed NLL and token count, so a resample weighs windows by their tokens as the metric does."""
    numerators, denominators = np.asarray(numerators, np.float64), np.asarray(denominators, np.float64)
    return Statistic(
        lambda index: transform(numerators[index].sum() / max(denominators[index].sum(), 1.0)), len(numerators)
    )


def paired_interval(
    before: Statistic, after: Statistic, seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL
) -> tuple[float, float]:
    """The `level` percentile interval of after - before over `resamples` paired bootstrap resamples of the
    examples (the same indices for both)."""
    examples = after.examples
    if examples < 2:
        return (math.nan, math.nan)
    generator = np.random.default_rng(seed)
    deltas = np.array(
        [after(index) - before(index) for index in generator.integers(0, examples, size=(resamples, examples))]
    )
    tail = (1 - level) / 2
    return float(np.quantile(deltas, tail)), float(np.quantile(deltas, 1 - tail))


def perplexity_change(before: SequenceNLL, after: SequenceNLL, seed: int = 0) -> tuple[float, tuple[float, float]]:
    """The relative perplexity change from `before` to `after` on the same sequences, and its paired bootstrap
    interval (of the mean token NLL's difference, whose exp less 1 is the change)."""
    low, high = paired_interval(ratio_of(before.nll, before.tokens), ratio_of(after.nll, after.tokens), seed)
    return math.expm1(after.mean - before.mean), (math.expm1(low), math.expm1(high))


def mcnemar(correct_before, correct_after) -> float:
    """McNemar's exact two-sided p-value: under no change, the examples that only one model gets right are as
    likely to favour either (a binomial with p = 1/2 over those discordant examples)."""
    before, after = np.asarray(correct_before, bool), np.asarray(correct_after, bool)
    lost, won = int((before & ~after).sum()), int((~before & after).sum())
    n, k = lost + won, min(lost, won)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def compare(
    before: Statistic, after: Statistic, seed: int = 0, correct: tuple | None = None
) -> dict[str, float | bool]:
    """The difference after - before on all the examples (the same ones: refused otherwise), its paired
    bootstrap interval, whether it is within noise (the interval holds 0), and for accuracy (`correct`:
    per-example correctness before and after) the McNemar p-value, which then must also be at least
    1 - LEVEL for noise."""
    if before.examples != after.examples:
        raise ValueError(
            f"a paired comparison needs the same examples ({before.examples} before, {after.examples} after)"
        )
    low, high = paired_interval(before, after, seed)
    out: dict[str, float | bool] = {
        "delta": after.value() - before.value(),
        "low": low,
        "high": high,
        "level": LEVEL,
        "examples": after.examples,
    }
    noise = not (low > 0 or high < 0) if not math.isnan(low) else True
    if correct is not None:
        out["p_value"] = mcnemar(*correct)
        noise = noise and out["p_value"] >= 1 - LEVEL
    out["noise"] = bool(noise)
    return out


def describe(change: dict) -> str:
    """The difference in words: its interval, the p-value where there is one, and whether it is noise."""
    p = f"; McNemar p = {change['p_value']:.2g}" if "p_value" in change else ""
    verdict = "within noise" if change["noise"] else "real, " + ("higher" if change["delta"] > 0 else "lower")
    return (
        f"{change['delta']:+.4f} ({100 * change['level']:.0f}% CI {change['low']:+.4f} to "
        f"{change['high']:+.4f}{p}): {verdict}"
    )
