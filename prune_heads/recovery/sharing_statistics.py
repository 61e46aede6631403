"""What shared KV heads would give, recorded on the unpruned model so that a sharing of a layer is refitted in
closed form: per attention layer, its output projection's inputs beside what query heads give when their KV
heads read others (`Alternative`s, keys mapped, `prune_heads.model.kv_sharing`). Recorded for every turn (each KV
head reading the one 1, 2, ... places on: `sharing_statistics`), one Gram matrix per layer serves the refit of
every sharing of it (and of query heads re-pointed one by one), as the unpruned one serves every removal;
recorded for one sharing's re-pointed heads alone (`SharedStatistics.of`, what the default path tries), it
serves that sharing at a fraction of the size. `shared_columns` says where a re-pointed head's features lie in
either (`reconstruction.refit` with `reads`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..model.hooks import Hook, hooks
from ..model.kv_sharing import KeyMaps, Merges, fit_key_maps, head_slots, maps_keys, shared_kv, why_not_shared
from ..model.layers import AttentionLayer, find_attention, resolve
from ..model.surgery import head_features
from ..scoring.recording import Moments, token_rows


@dataclass(frozen=True)
class Alternative:
    """One extra run of a layer recorded beside its own inputs: the KV heads its query heads read in it (`merges`:
    a KV head -> the one its query heads read instead) and the query heads (positions among the layer's) whose
    output-projection inputs are kept."""

    merges: Merges
    positions: tuple[int, ...]


def turns(layer: AttentionLayer) -> list[Merges]:
    """For s = 1 .. KV heads - 1, every KV head of the layer reading the one s places on (as `shared_kv` takes
    it: not a layout, a way to record what each query head gives on each other KV head at once)."""
    kv = layer.kv_heads
    return [{kv[i]: kv[(i + s) % len(kv)] for i in range(len(kv))} for s in range(1, len(kv))]


def every_turn(layer: AttentionLayer) -> list[Alternative]:
    """Each turn with every query head kept: what serves every sharing of the layer."""
    return [Alternative(turn, tuple(range(len(layer.heads)))) for turn in turns(layer)]


def repointed(layer: AttentionLayer, merges: Merges) -> Alternative:
    """One sharing with the query heads it re-points kept: what serves that sharing alone."""
    return Alternative(merges, tuple(p for p, h in enumerate(layer.heads) if layer.kv_of(h) in merges))


def reading(layer: AttentionLayer, merges: Merges) -> dict[int, int]:
    """The query heads `merges` re-point, each to the KV head it reads instead."""
    return {h: merges[layer.kv_of(h)] for h in layer.heads if layer.kv_of(h) in merges}


def shared_columns(
    layer: AttentionLayer, removed: Iterable[int], reads: Mapping[int, int], recorded: list[Alternative]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the features a refit fits once `removed` heads go and each query head of `reads` reads the KV head
    it names lie in statistics that record `recorded` beside the layer's own inputs, and each one's own input
    feature: (kept, own). A re-pointed head's come from an alternative whose run has it read that KV head; every
    other kept head's are its own."""
    gone, cpu = set(removed), torch.device("cpu")
    starts = [len(layer.heads)]  # where each alternative's heads begin, in heads
    for alternative in recorded[:-1]:
        starts.append(starts[-1] + len(alternative.positions))
    kept, own = [], []
    for position, head in enumerate(layer.heads):
        if head in gone:
            continue
        kv = layer.kv_of(head)
        found = position
        if head in reads:
            found = next(
                start + a.positions.index(position)
                for start, a in zip(starts, recorded)
                if a.merges.get(kv) == reads[head] and position in a.positions
            )
        kept.append(found)
        own.append(position)
    return head_features(kept, layer.head_dim, cpu), head_features(own, layer.head_dim, cpu)


def sharable(layers: list[AttentionLayer]) -> list[AttentionLayer]:
    """The layers whose KV heads can be shared."""
    return [layer for layer in layers if why_not_shared(layer) is None]


def turn_maps(products: dict[str, torch.Tensor], layer: AttentionLayer) -> list[KeyMaps]:
    """Each turn's key maps for the layer (none where its keys are not mapped)."""
    if layer.name not in products:
        return [{} for _ in turns(layer)]
    return [fit_key_maps(products[layer.name], turn, layer.kv_heads) for turn in turns(layer)]


def key_products(
    model: nn.Module, layers: list[AttentionLayer], batches: Iterable[dict], forward: Forward | None = None
) -> dict[str, torch.Tensor]:
    """Per layer whose keys can be mapped (`maps_keys`), the sums over the batches' tokens (padding left out)
    of z_j conj(z_g) for every pair of its KV heads j, g and rotary pair: [kv, kv, head_dim // 2] complex128,
    where z is a key's pair read as a complex number before the rotary embedding; the model run by `forward`
    (a gated model's unpruned state) where given."""
    mappable = [layer for layer in layers if maps_keys(layer)]
    sums = {
        layer.name: torch.zeros(len(layer.kv_heads), len(layer.kv_heads), layer.head_dim // 2, dtype=torch.complex128)
        for layer in mappable
    }
    mask: list[torch.Tensor | None] = [None]

    def adding(layer: AttentionLayer) -> Hook:
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            keys = token_rows(out.detach().double(), mask[0]).reshape(-1, len(layer.kv_heads), layer.head_dim)
            half = layer.head_dim // 2
            z = torch.complex(keys[..., :half], keys[..., half:]).cpu()  # [tokens, kv, pairs]
            sums[layer.name] += torch.einsum("tjp,tgp->jgp", z, z.conj())

        return (head_slots(layer)["k"].projection.module, "forward", hook)

    run = forward or (lambda batch: model(**batch))
    with torch.no_grad(), hooks(adding(layer) for layer in mappable):
        for batch in batches:
            mask[0] = batch.get("attention_mask")
            run(batch)
    return sums


Forward = Callable[[dict], Any]  # runs the model on a batch
Recorded = dict[str, list[tuple[Alternative, KeyMaps]]]  # layer name -> its alternatives, each with its key maps


class Alternatives:
    """Hooks that record, over forward passes of the unpruned model, each layer's `Moments` of its
    output-projection inputs followed by the kept heads' of each of its alternatives (`recorded`): the layer is
    called again once per alternative inside its own call, on the same inputs, so every layer sees the unpruned
    model's stream."""

    def __init__(self, layers: list[AttentionLayer], recorded: Recorded) -> None:
        self.layers, self.recorded = [l for l in layers if l.name in recorded], recorded
        self.moments = {l.name: Moments(self._width(l), True) for l in self.layers}
        self.mask: torch.Tensor | None = None
        self._seen: dict[str, list[torch.Tensor]] = {l.name: [] for l in self.layers}
        self._inside = False

    def _width(self, layer: AttentionLayer) -> int:
        """The features recorded for the layer: its own inputs, then each alternative's kept heads'."""
        return layer.head_dim * (len(layer.heads) + sum(len(a.positions) for a, _ in self.recorded[layer.name]))

    def registrations(self) -> list[Hook]:
        """The hooks: one before each output projection, one after each layer's attention."""
        found: list[Hook] = []
        for layer in self.layers:
            found.append((resolve(layer.module, layer.spec.o), "forward_pre", self._seeing(layer.name)))
            found.append((layer.module, "forward", self._turning(layer)))
        return found

    def _seeing(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._seen[name].append(args[0].detach())

        return hook

    def _turning(self, layer: AttentionLayer):
        alternatives = self.recorded[layer.name]
        kept = [head_features(list(a.positions), layer.head_dim, torch.device("cpu")) for a, _ in alternatives]

        def hook(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
            if self._inside:
                return
            self._inside = True
            try:
                for alternative, maps in alternatives:
                    with shared_kv([layer], {layer.name: alternative.merges}, {layer.name: maps}):
                        module(*args, **kwargs)
            finally:
                self._inside = False
            own, *runs = self._seen[layer.name]
            self._seen[layer.name] = []
            columns = [own] + [run[..., index.to(run.device)] for run, index in zip(runs, kept)]
            self.moments[layer.name].add(token_rows(torch.cat(columns, -1), self.mask))

        return hook


@torch.no_grad()
def record_alternatives(
    model: nn.Module,
    layers: list[AttentionLayer],
    batches: Iterable[dict],
    recorded: Recorded,
    forward: Forward | None = None,
) -> dict[str, Moments]:
    """Per layer of `recorded`, the Moments of its output-projection inputs and of its alternatives' kept heads
    (`Alternatives`), over one pass of the unpruned model on `batches` (run by `forward` where given)."""
    run = forward or (lambda batch: model(**batch))
    recorder = Alternatives(layers, recorded)
    with hooks(recorder.registrations(), with_kwargs=True):
        for batch in batches:
            recorder.mask = batch.get("attention_mask")
            run({**batch, "use_cache": False})
    return recorder.moments


def sharing_statistics(
    model: nn.Module, layers: list[AttentionLayer], calibration: list[dict], heldout: list[dict], mapped: bool = True
) -> tuple[dict[str, Moments], dict[str, Moments], dict[str, list[KeyMaps]]]:
    """The calibration's and the held-out batches' statistics of every turn of every sharable layer
    (`record_alternatives` of `every_turn`) with the key maps they were recorded with: fitted on the
    calibration's keys, or none (`mapped` False: keys read as they are)."""
    shared = sharable(layers)
    products = key_products(model, shared, calibration) if mapped else {}
    maps = {layer.name: turn_maps(products, layer) for layer in shared}
    recorded = {layer.name: list(zip(every_turn(layer), maps[layer.name])) for layer in shared}
    fitted = record_alternatives(model, shared, calibration, recorded)
    return fitted, record_alternatives(model, shared, heldout, recorded), maps


def merge_maps(maps: list[KeyMaps], layer: AttentionLayer, merges: Merges) -> KeyMaps:
    """The key maps of `merges` in the layer, taken from the turns' (each merge is one turn's entry)."""
    count = len(layer.kv_heads)
    found = {}
    for j, g in merges.items():
        shift = (layer.kv_heads.index(g) - layer.kv_heads.index(j)) % count
        if j in maps[shift - 1]:
            found[j] = maps[shift - 1][j]
    return found


def kv_merges(layer: AttentionLayer, removed: Iterable[int], products: torch.Tensor | None = None) -> Merges | None:
    """The sharing that cuts the layer's KV cache as removing `removed` does while every query head stays: each
    KV group the removal empties merged into one it keeps, each kept one taking as many (a grouped-query layout),
    the pairs whose keys are most alike first (by `products`, from `key_products`; else in order). None where
    the removal is not of whole KV groups, keeps none, or leaves a count no layout has."""
    gone = set(removed)
    emptied = [kv for kv in layer.kv_heads if all(h in gone for h in layer.heads if layer.kv_of(h) == kv)]
    kept = [kv for kv in layer.kv_heads if kv not in emptied]
    whole = all(layer.kv_of(h) in emptied for h in gone)
    if not (emptied and kept and whole) or len(emptied) % len(kept) or why_not_shared(layer) is not None:
        return None
    pairs = sorted(((j, g) for j in emptied for g in kept), key=lambda pair: -_alike(layer, products, *pair))
    merges: Merges = {}
    load = dict.fromkeys(kept, 0)
    for j, g in pairs:
        if j not in merges and load[g] < len(emptied) // len(kept):
            merges[j] = g
            load[g] += 1
    return merges


def _alike(layer: AttentionLayer, products: torch.Tensor | None, j: int, g: int) -> float:
    """How much of KV head j's keys a complex scale per rotary pair of g's explains, summed over the pairs
    (each pair's squared correlation; 0 without `products`)."""
    if products is None:
        return 0.0
    a, b = layer.kv_heads.index(j), layer.kv_heads.index(g)
    energy = (products[a, a].real * products[b, b].real).clamp_min(torch.finfo(torch.float64).tiny)
    return float((products[a, b].abs() ** 2 / energy).sum())


@dataclass(frozen=True)
class SharedStatistics:
    """What the default path tries a plan's sharing with: per layer whose cut can keep its query heads
    (`kv_merges`), the merges, the key maps fitted on the calibration's keys and the statistics of its re-pointed
    heads (`repointed`) on the calibration and the held-out batches; `plan`: the plan they were recorded for
    (None for a sharing given whole), so the same plan's are recorded once."""

    merges: dict[str, Merges]
    maps: dict[str, KeyMaps]
    calibration: dict[str, Moments]
    heldout: dict[str, Moments]
    plan: dict[str, list[int]] | None = None

    @classmethod
    def of(
        cls,
        model: nn.Module,
        forward: Forward,
        plan: dict[str, list[int]],
        calibration: list[dict],
        heldout: list[dict],
    ) -> SharedStatistics:
        """Recorded for `plan` on the unpruned model, run by `forward`: a pass over the calibration batches for
        the keys, then one over each set for the statistics (none where no layer's cut can keep its query
        heads)."""
        layers = find_attention(model)
        cut = [layer for layer in layers if plan.get(layer.name) and kv_merges(layer, plan[layer.name]) is not None]
        if not cut:
            return cls({}, {}, {}, {}, dict(plan))
        products = key_products(model, cut, calibration, forward)
        merges = {l.name: kv_merges(l, plan[l.name], products.get(l.name)) or {} for l in cut}
        recorded = cls._recorded(model, forward, merges, products, calibration, heldout)
        return replace(recorded, plan=dict(plan))

    @classmethod
    def given(
        cls, model: nn.Module, forward: Forward, merges: dict[str, Merges], calibration: list[dict], heldout: list[dict]
    ) -> SharedStatistics:
        """Recorded for a sharing given whole (`{layer name: merges}`, checked) as `of` records a plan's."""
        cut = [layer for layer in find_attention(model) if layer.name in merges]
        products = key_products(model, cut, calibration, forward)
        return cls._recorded(model, forward, merges, products, calibration, heldout)

    @classmethod
    def _recorded(
        cls,
        model: nn.Module,
        forward: Forward,
        merges: dict[str, Merges],
        products: dict[str, torch.Tensor],
        calibration: list[dict],
        heldout: list[dict],
    ) -> SharedStatistics:
        """The key maps of `merges` fitted on `products` and the statistics of their re-pointed heads."""
        cut = [layer for layer in find_attention(model) if layer.name in merges]
        by_name = {layer.name: layer for layer in cut}
        maps = {
            name: fit_key_maps(products[name], m, by_name[name].kv_heads) if name in products else {}
            for name, m in merges.items()
        }
        recorded = {name: [(repointed(by_name[name], m), maps[name])] for name, m in merges.items()}
        fitted = record_alternatives(model, cut, calibration, recorded, forward)
        held = record_alternatives(model, cut, heldout, recorded, forward) if heldout else {}
        return cls(merges, maps, fitted, held)
