"""What shared KV heads would give, recorded on the unpruned model so that any sharing of a layer is refitted in
closed form: per attention layer, its output projection's inputs beside what every query head gives when each
KV head reads, in turn, the one 1, 2, ... places on (keys mapped, `prune_heads.model.sharing`). Any merge of
KV head j into g is one of those turns for j's query heads, so one Gram matrix per layer serves the refit of
every sharing of it (`reconstruction.refit` with `merges`), as the unpruned one serves every removal."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..model.hooks import Hook, hooks
from ..model.layers import AttentionLayer, resolve
from ..model.sharing import KeyMaps, Merges, fit_key_maps, head_slots, maps_keys, shared_kv, why_not_shared
from ..scoring.recording import Moments, token_rows


def turns(layer: AttentionLayer) -> list[Merges]:
    """For s = 1 .. KV heads - 1, every KV head of the layer reading the one s places on (as `shared_kv` takes
    it: not a layout, a way to record what each query head gives on each other KV head at once)."""
    kv = layer.kv_heads
    return [{kv[i]: kv[(i + s) % len(kv)] for i in range(len(kv))} for s in range(1, len(kv))]


def sharable(layers: list[AttentionLayer]) -> list[AttentionLayer]:
    """The layers whose KV heads can be shared."""
    return [layer for layer in layers if why_not_shared(layer) is None]


def turn_maps(products: dict[str, torch.Tensor], layer: AttentionLayer) -> list[KeyMaps]:
    """Each turn's key maps for the layer (none where its keys are not mapped)."""
    if layer.name not in products:
        return [{} for _ in turns(layer)]
    return [fit_key_maps(products[layer.name], turn, layer.kv_heads) for turn in turns(layer)]


def key_products(model: nn.Module, layers: list[AttentionLayer], batches: Iterable[dict]) -> dict[str, torch.Tensor]:
    """Per layer whose keys can be mapped (`maps_keys`), the sums over the batches' tokens (padding left out)
    of z_j conj(z_g) for every pair of its KV heads j, g and rotary pair: [kv, kv, head_dim // 2] complex128,
    where z is a key's pair read as a complex number before the rotary embedding."""
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

    with torch.no_grad(), hooks(adding(layer) for layer in mappable):
        for batch in batches:
            mask[0] = batch.get("attention_mask")
            model(**batch)
    return sums


class Alternatives:
    """Hooks that record, over forward passes of the unpruned model, each sharable layer's `Moments` of its
    output-projection inputs followed by those of every turn (`turns`): the layer is called again once per turn
    inside its own call, on the same inputs, so every layer sees the unpruned model's stream."""

    def __init__(self, layers: list[AttentionLayer], maps: dict[str, list[KeyMaps]]) -> None:
        self.layers, self.maps = layers, maps
        self.moments = {l.name: Moments(len(l.kv_heads) * l.num_heads * l.head_dim, True) for l in layers}
        self.mask: torch.Tensor | None = None
        self._seen: dict[str, list[torch.Tensor]] = {l.name: [] for l in layers}
        self._inside = False

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
        def hook(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
            if self._inside:
                return
            self._inside = True
            try:
                for turn, maps in zip(turns(layer), self.maps[layer.name]):
                    with shared_kv([layer], {layer.name: turn}, {layer.name: maps}):
                        module(*args, **kwargs)
            finally:
                self._inside = False
            seen, self._seen[layer.name] = self._seen[layer.name], []
            self.moments[layer.name].add(token_rows(torch.cat(seen, -1), self.mask))

        return hook


@torch.no_grad()
def record_alternatives(
    model: nn.Module, layers: list[AttentionLayer], batches: Iterable[dict], maps: dict[str, list[KeyMaps]]
) -> dict[str, Moments]:
    """Per sharable layer, the Moments of its output-projection inputs and of every turn's (`Alternatives`), over
    one pass of the unpruned model on `batches`, the turns' keys mapped by `maps` (`turn_maps`)."""
    recorder = Alternatives(sharable(layers), maps)
    with hooks(recorder.registrations(), with_kwargs=True):
        for batch in batches:
            recorder.mask = batch.get("attention_mask")
            model(**batch, use_cache=False)
    return recorder.moments


def sharing_statistics(
    model: nn.Module, layers: list[AttentionLayer], calibration: list[dict], heldout: list[dict], mapped: bool = True
) -> tuple[dict[str, Moments], dict[str, Moments], dict[str, list[KeyMaps]]]:
    """The calibration's and the held-out batches' alternatives (`record_alternatives`) with the key maps they
    were recorded with: fitted on the calibration's keys, or none (`mapped` False: keys read as they are)."""
    shared = sharable(layers)
    products = key_products(model, shared, calibration) if mapped else {}
    maps = {layer.name: turn_maps(products, layer) for layer in shared}
    fitted = record_alternatives(model, shared, calibration, maps)
    return fitted, record_alternatives(model, shared, heldout, maps), maps


def merge_maps(maps: list[KeyMaps], layer: AttentionLayer, merges: Merges) -> KeyMaps:
    """The key maps of `merges` in the layer, taken from the turns' (each merge is one turn's entry)."""
    count = len(layer.kv_heads)
    found = {}
    for j, g in merges.items():
        shift = (layer.kv_heads.index(g) - layer.kv_heads.index(j)) % count
        if j in maps[shift - 1]:
            found[j] = maps[shift - 1][j]
    return found
