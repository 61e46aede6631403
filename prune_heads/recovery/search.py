"""The searched plan: remove heads in rounds by their measured cost. Each round measures, for every unit that
may still go (a KV group, a head, one head of every group, a whole block: as selection removes them), the
divergence of the model from the unpruned one when that unit goes on top of what went in earlier rounds, each
pruned layer with its reconstruction, and removes the cheapest units up to the round's share of the budget.
Per-head estimates (gradients, Fisher blocks, a layer's own reconstruction error) cannot see what a layer's
removal does further on, nor that a head the others stood in for matters once its neighbour has gone; this
measures both, at the price of one forward pass over a few calibration examples per unit and round, from
the unit's block on where the model is one chain of blocks (`prune_heads.model.blocks`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from ..scoring.head_scores import HeadScores

Unit = tuple[str, tuple[int, ...]]  # (layer name, original heads that go together)
# The default rounds where the outputs are per position (a language model's tokens). Where each example gives
# one output (a class, a value, an embedding) the default runs none: on the classifier fixtures its plan lost
# on held-out data in every cell measured, even on 256 examples (benchmarks/README.md, the searched plan).
ROUNDS = 2


def search_order(
    units: dict[str, tuple[list[tuple[int, ...]], int]],
    budget: int,
    rounds: int,
    cost: Callable[[dict[str, tuple[int, ...]], str], float],
) -> tuple[list[Unit], list[int]]:
    """The units in the order the search removes them, then the units it leaves by their last measured cost,
    and per round run the number of units still present at its start (what its work is priced by: the same
    on any device, whichever units the measured values make eligible). `units[layer] = (its units, how many
    heads it may lose)`; `budget` heads go in `rounds` rounds of equal shares; `cost(plan, layer)` measures
    the plan whose `layer` differs from the state so far."""
    removed: dict[str, tuple[int, ...]] = {}
    order: dict[Unit, None] = {}  # the units removed, in order (a dict: membership at thousands of units)
    last: dict[Unit, float] = {}
    present: list[int] = []
    total = sum(len(u) for u, _ in units.values())
    for r in range(rounds):
        gone = sum(len(h) for h in removed.values())
        if gone >= budget:
            break
        present.append(total - len(order))
        share = math.ceil((budget - gone) / (rounds - r))
        costs: dict[Unit, float] = {}
        for name, (layer_units, room) in units.items():
            for unit in layer_units:
                heads = removed.get(name, ())
                if (name, unit) not in order and len(heads) + len(unit) <= room:
                    costs[(name, unit)] = cost({**removed, name: tuple(sorted(heads + unit))}, name)
        if not costs:
            break
        last = costs
        taken = 0
        for name, unit in sorted(costs, key=costs.__getitem__):
            heads = removed.get(name, ())
            if taken >= share:
                break
            if len(heads) + len(unit) <= units[name][1]:
                order[(name, unit)] = None
                removed[name] = tuple(sorted(heads + unit))
                taken += len(unit)
    left = [u for u in sorted(last, key=last.__getitem__) if u not in order]
    never = [(n, u) for n, (us, _) in units.items() for u in us if (n, u) not in order and (n, u) not in last]
    return [*order, *left, *never], present


def searched_scores(scores: HeadScores, order: list[Unit]) -> HeadScores:
    """Scores that rank the heads as `order` does (a unit's place, shared out over its heads), so that
    `select_heads` with them takes the searched units under every constraint of the budget; heads in no unit
    (protected layers) score above all."""
    place = {(name, h): i / len(unit) for i, (name, unit) in enumerate(order) for h in unit}
    top = float(len(order) + 1)
    values = {
        name: torch.tensor([place.get((name, h), top) for h in heads], dtype=torch.float32)
        for name, heads in scores.heads.items()
    }
    return dataclasses.replace(scores, method="search", scores=values, variance=None, meta={})
