"""HeadScores: the importance of every present head, per attention layer, as scoring methods return it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class HeadScores:
    """Importance of every present head, per attention layer (higher = more important).

    `scores[name]` is a float32 tensor over the layer's present heads, whose ORIGINAL indices are
    `heads[name]`; `group_sizes[name]` is the layer's original query heads per KV head (1 without GQA).
    """

    method: str
    num_examples: int
    scores: dict[str, torch.Tensor]
    heads: dict[str, tuple[int, ...]]
    group_sizes: dict[str, int]
    original_heads: dict[str, int]
    variance: dict[str, torch.Tensor] | None = None
    meta: dict = field(default_factory=dict)

    @property
    def layers(self) -> list[str]:
        """Layer names in forward order."""
        return list(self.scores)

    def to_dict(self) -> dict:
        """A JSON-ready dict (scores as lists, keyed by layer name)."""

        def lists(tensors):
            return None if tensors is None else {k: [float(x) for x in v] for k, v in tensors.items()}

        return {
            "method": self.method,
            "num_examples": self.num_examples,
            "scores": lists(self.scores),
            "heads": {k: list(v) for k, v in self.heads.items()},
            "group_sizes": self.group_sizes,
            "original_heads": self.original_heads,
            "variance": lists(self.variance),
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict) -> HeadScores:
        """Inverse of `to_dict`."""

        def tensors(lists):
            return None if lists is None else {k: torch.tensor(v, dtype=torch.float32) for k, v in lists.items()}

        return cls(
            method=data["method"],
            num_examples=data["num_examples"],
            scores=tensors(data["scores"]),
            heads={k: tuple(v) for k, v in data["heads"].items()},
            group_sizes=data["group_sizes"],
            original_heads=data["original_heads"],
            variance=tensors(data.get("variance")),
            meta=data.get("meta", {}),
        )

    def save(self, path: str | Path) -> None:
        """Write the scores as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> HeadScores:
        """Read scores written by `save`."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def matrix(self) -> torch.Tensor:
        """[layers, max original heads] with NaN where a head is absent (removed or beyond the layer)."""
        width = max(self.original_heads.values())
        grid = torch.full((len(self.scores), width), float("nan"))
        for row, name in enumerate(self.scores):
            grid[row, list(self.heads[name])] = self.scores[name]
        return grid
