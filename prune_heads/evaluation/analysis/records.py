"""What `analyze` finds, as frozen records of plain numbers (tuples, not tensors), saved and read as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

Matrix = tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class LayerAnalysis:
    """One attention layer, per present head (ORIGINAL indices in `heads`).

    `importance` is the default scoring method's value per example, with its 95% interval over resampled
    batches (`low`, `high`); `rank` the head's place among all the model's heads (0 = least important), with the
    5th to 95th percentile of that place over the resamples (`rank_low`, `rank_high`). `written` is the root mean
    square norm per token of what each head writes through the output projection, `similarity[i][j]` the
    cosine, over the same tokens, of what heads i and j write (so head j scaled by similarity[i][j] * written[i]
    / written[j] is the least-squares stand-in for head i). `key_share` and
    `value_share` (grouped-query layers) say how much of KV head i's keys and values KV head j's explain: keys
    by a complex scale per rotary pair (what sharing can fold into the queries), values by a linear map.
    Behaviour, averaged over query tokens: `entropy` of the attention (nats), mean `distance` to the keys
    attended (tokens), and the share of attention on the `first` token, the `previous` one and the `same`
    (None where the layer's attention weights could not be read: cross-attention).
    """

    name: str
    heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    group_size: int
    importance: tuple[float, ...]
    low: tuple[float, ...]
    high: tuple[float, ...]
    rank: tuple[int, ...]
    rank_low: tuple[int, ...]
    rank_high: tuple[int, ...]
    written: tuple[float, ...]
    similarity: Matrix
    key_share: Matrix | None
    value_share: Matrix | None
    entropy: tuple[float, ...] | None
    distance: tuple[float, ...] | None
    first: tuple[float, ...] | None
    previous: tuple[float, ...] | None
    same: tuple[float, ...] | None


@dataclass(frozen=True)
class Pair:
    """Two heads of one layer whose outputs are near-duplicates (`kind` "heads"), or two KV heads whose keys and
    values are (`kind` "kv"): `similarity` is their cosine, or the smaller of the key and value shares."""

    layer: str
    a: int
    b: int
    similarity: float
    kind: str


@dataclass(frozen=True)
class CutCost:
    """The divergence from the unpruned model (per example, mean and 95% interval) when the `units` least
    important heads or KV groups go (`heads` query heads, `plan` their original indices), gates at zero: what
    removing them costs before any recovery, measured on `examples` examples."""

    units: int
    heads: int
    divergence: float
    low: float
    high: float
    examples: int
    plan: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Analysis:
    """Where a model's heads matter and where they repeat each other, from `analyze`.

    `unit` names what the cut removes ("KV group" or "head"); `rank_agreement` is the mean Spearman
    correlation of the heads' ranking on resampled batches with the ranking on all of them (1: the order does
    not depend on which batches were seen); `passes` the counted work in fisher passes (one forward and
    backward pass over the batches)."""

    model: str
    method: str
    examples: int
    batches: int
    unit: str
    layers: tuple[LayerAnalysis, ...]
    duplicates: tuple[Pair, ...]
    costs: tuple[CutCost, ...]
    rank_agreement: float
    passes: float

    def to_dict(self) -> dict:
        """A JSON-ready dict."""
        return asdict(self)

    def save(self, path: str | Path) -> None:
        """Write the analysis as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Analysis:
        """Read an analysis written by `save`."""
        return from_dict(json.loads(Path(path).read_text()))


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def from_dict(data: dict) -> Analysis:
    """Inverse of `Analysis.to_dict`."""
    layers = tuple(LayerAnalysis(**{k: _tuples(v) for k, v in layer.items()}) for layer in data["layers"])
    duplicates = tuple(Pair(**pair) for pair in data["duplicates"])
    costs = tuple(CutCost(**{k: _tuples(v) for k, v in cost.items()}) for cost in data["costs"])
    rest = {k: v for k, v in data.items() if k not in ("layers", "duplicates", "costs")}
    return Analysis(layers=layers, duplicates=duplicates, costs=costs, **rest)
