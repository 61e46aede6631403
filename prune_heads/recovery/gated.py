"""`GatedModel`: the unpruned model with a gate per head, an added bias and an optional low-rank update per
output projection (hooks), so candidate plans, bias compensation and tuning are tried without copying or
changing a weight; gate 0 is exactly the head's removal, so what is measured here is what `prune` then
produces (`fold`)."""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import nn

from ..model.gates import fold_gates, gated_features, head_gates
from ..model.hooks import hooks
from ..model.kv_sharing import KeyMaps, Merges, apply_sharing, prove_sharing, shared_kv
from ..model.layers import AttentionLayer, find_attention, output_projection, resolve
from ..model.onload import passes
from ..model.probe import probe_plan, remove_proven
from ..model.surgery import add_output_bias, head_features, normalize_plan
from ..runtime.devices import on_device_of
from ..runtime.parallel import Shards
from ..scoring.objective import Objective
from .reconstruction import Refit, kept_and_removed


class _GatedDown(torch.autograd.Function):
    """`gated @ down.t()`, an update's first step on the gated features, whose backward keeps the ungated
    input and the gates (which the gate itself keeps) instead of `gated`, and makes `gated` again from them:
    the gradients of the plain product bit for bit, without a gated copy of every layer's input alive until
    the backward pass (in tuning, the flow's peak, 3% of the weights)."""

    @staticmethod
    def forward(ctx, gated, down, ungated, gate, head_dim):
        ctx.save_for_backward(down, ungated, gate)
        ctx.head_dim = head_dim
        return gated @ down.t()

    @staticmethod
    def backward(ctx, grad):
        down, ungated, gate = ctx.saved_tensors
        gated = gated_features(ungated, gate, ctx.head_dim)
        rows = grad.reshape(-1, grad.shape[-1])  # as matmul folds [..., rank] for its mm
        # the products autograd's mm backward forms (for `down.t()`, column-major, gradᵀ x), so the sums agree
        grad_gated = rows.mm(down).view(gated.shape) if ctx.needs_input_grad[0] else None
        grad_down = rows.t().mm(gated.reshape(-1, gated.shape[-1])) if ctx.needs_input_grad[1] else None
        return grad_gated, grad_down, None, None, None


class GatedModel:
    """The model with a gate per head (`scales` x `masks`), an added bias per output projection (`biases`)
    and, once `add_updates` is called, a low-rank update of each output projection (`updates`: (down, up)
    with down [rank, in] and up [out, rank], adding x @ downᵀ @ upᵀ), all hooks: call it on a batch to run
    the gated model. Plans are tried by zeroing masks; gate 0 gives exactly the outputs of the model with that
    head removed, and `fold` makes it so. A plan's reconstruction (`Refit`s) is swapped into the output
    projections' kept columns: each `Refit.weight` holds the columns it replaced (no copy of the weights is
    made) until `restore` swaps them back or `prove` commits to the fit, so any other state can be tried
    after it."""

    def __init__(self, model: nn.Module, layers: list[AttentionLayer]) -> None:
        self.model, self.layers = model, layers
        self.index = {layer.name: i for i, layer in enumerate(layers)}  # layer name -> its place in `layers`
        projections = [output_projection(l) for l in layers]
        self.devices = [p.module.weight.device for p in projections]
        self.widths = [p.features("out") for p in projections]
        self._originals: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (kept columns, their originals)
        self._proven: tuple[dict, dict[str, list[int]]] | None = None  # the plan `prove` last proved, normalized
        self._inputs: dict[int, torch.Tensor] = {}  # layer -> its ungated input, from the pre-hook to the update
        self._stack, self._shared = ExitStack(), ExitStack()  # the gates' hooks; the sharing's, while inside
        self._inside = False
        self.use({})

    def use(
        self,
        plan: dict[str, list[int]],
        biases: dict[str, torch.Tensor] | None = None,
        refits: dict[str, Refit] | None = None,
        sharing: dict[str, Merges] | None = None,
        key_maps: dict[str, KeyMaps] | None = None,
    ) -> None:
        """Gates of 0 for the plan's heads and 1 for the others, and the given added biases (else none); with
        `refits`, those layers' fitted kept columns and biases (in place of any added bias); with `sharing`, those
        KV heads shared (keys mapped by `key_maps`, run as hooks: `shared_kv`). No updates."""
        self.restore()
        self.sharing = {name: dict(merges) for name, merges in (sharing or {}).items() if merges}
        self.key_maps = {name: dict((key_maps or {}).get(name, {})) for name in self.sharing}
        self._share()
        self.updates: list[tuple[torch.Tensor, torch.Tensor]] = []
        biases = dict(biases or {})
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                fitted = (refits or {}).get(layer.name)
                if fitted is None:
                    continue
                projection = output_projection(layer)
                kept, _ = kept_and_removed(layer, plan.get(layer.name, ()))
                self._swap(projection.matrix(), kept, fitted.weight)
                self._originals[i] = (kept, fitted.weight)
                old = projection.module.bias
                biases[layer.name] = fitted.bias - (old.detach().double().cpu() if old is not None else 0.0)
        removed = [set(plan.get(l.name, ())) for l in self.layers]
        self.masks = [
            torch.tensor([0.0 if h in r else 1.0 for h in l.heads], device=d)
            for l, r, d in zip(self.layers, removed, self.devices)
        ]
        self.scales = [torch.ones(l.num_heads, device=d) for l, d in zip(self.layers, self.devices)]
        self.biases = [
            (biases or {}).get(l.name, torch.zeros(w)).float().to(d).clone()
            for l, w, d in zip(self.layers, self.widths, self.devices)
        ]

    def add_updates(self, rank: int, seed: int) -> list[torch.Tensor]:
        """Start a rank-`rank` update of every output projection, LoRA's form (Hu et al. 2022): `down` seeded
        random with unit-variance outputs, `up` zero, so the model is unchanged until they are tuned. Returns
        the tensors to tune."""
        generator = torch.Generator().manual_seed(seed)
        self.updates = []
        for layer, device, width in zip(self.layers, self.devices, self.widths):
            inner = output_projection(layer).features("in")
            down = torch.randn(rank, inner, generator=generator) / inner**0.5
            up = torch.zeros(width, rank, device=device)
            self.updates.append((down.to(device).requires_grad_(), up.requires_grad_()))
        return [t for update in self.updates for t in update]

    def tunables(self, gates: bool, biases: bool, rank: int | None, seed: int) -> dict[str, list[torch.Tensor]]:
        """Make the gates' scales and the added biases tunable as asked and, with a `rank`, start a low-rank
        update of every output projection (`add_updates`); returns what to tune by kind: "gate", "bias",
        "projection"."""
        self.scales = [s.requires_grad_(gates) for s in self.scales]
        self.biases = [b.requires_grad_(biases) for b in self.biases]
        found = {}
        if gates:
            found["gate"] = self.scales
        if biases:
            found["bias"] = self.biases
        if rank is not None:
            found["projection"] = self.add_updates(rank, seed)
        return found

    def freeze(self) -> None:
        """Stop tuning: the scales, added biases and updates keep their values, detached."""
        self.scales = [s.detach() for s in self.scales]
        self.biases = [b.detach() for b in self.biases]
        self.updates = [(down.detach(), up.detach()) for down, up in self.updates]

    def untune(self, biases: list[torch.Tensor]) -> None:
        """Back to the state before tuning: scales of 1, the added `biases` it had, no updates (the refitted
        weights tuning never changed)."""
        self.scales = [torch.ones_like(s) for s in self.scales]
        self.biases, self.updates = biases, []

    @staticmethod
    @torch.no_grad()
    def _swap(weight: torch.Tensor, kept: torch.Tensor, other: torch.Tensor) -> None:
        """Exchange the weight's `kept` columns with `other` (same dtype), so the originals need no copy of
        their own: a refit holds them while its fit is in the weight."""
        kept = kept.to(weight.device)
        columns = weight[:, kept].to(other.device)
        weight[:, kept] = other.to(weight.device)
        other.copy_(columns)

    def restore(self) -> None:
        """Put back the output projections' columns that a reconstruction changed (its `Refit`s get their fit
        back)."""
        for i, (kept, held) in self._originals.items():
            self._swap(output_projection(self.layers[i]).matrix(), kept, held)
        self._originals.clear()

    def _share(self) -> None:
        """The state's sharing as hooks while the gated model runs (none outside its `with`)."""
        self._shared.close()
        if self._inside and self.sharing:
            self._shared.enter_context(shared_kv(self.layers, self.sharing, self.key_maps))

    def __enter__(self) -> GatedModel:
        self._inside = True
        self._share()
        self.gates = self._stack.enter_context(head_gates(self.model, requires_grad=False))
        projections = [resolve(l.module, l.spec.o) for l in self.layers]
        keep = [(o, "forward_pre", self._keep_input(i)) for i, o in enumerate(projections)]
        self._stack.enter_context(hooks(keep, prepend=True))  # before the gate: it sees the ungated input
        self._stack.enter_context(hooks((o, "forward", self._add(i)) for i, o in enumerate(projections)))
        return self

    def __exit__(self, *exc) -> None:
        self._inside = False
        self._shared.close()
        self._stack.close()

    def _keep_input(self, i: int):
        """The pre-hook (before the gate) that keeps layer i's ungated input for its update's backward."""

        def hook(module: nn.Module, args: tuple) -> None:
            if self.updates:
                self._inputs[i] = args[0]

        return hook

    def _add(self, i: int):
        """The hook that adds layer i's bias and update (its input is the gated features)."""
        head_dim = self.layers[i].head_dim

        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            out = out + self.biases[i].to(out.dtype)
            if self.updates:
                down, up = self.updates[i]
                start = _GatedDown.apply(args[0], down.to(out.dtype), self._inputs.pop(i), self.gates[i], head_dim)
                out = out + start @ up.to(out.dtype).t()
            return out

        return hook

    def __call__(self, batch: dict):
        for i, (scale, mask) in enumerate(zip(self.scales, self.masks)):
            self.gates[i] = scale * mask
        return self.model(**batch)

    @torch.no_grad()
    def divergences(
        self, batches: list[dict], targets: list, objective: Objective, layer_major: bool = True
    ) -> torch.Tensor:
        """Per-example held-out values of the gated model against the targets (`Objective.heldout`: the
        divergence, plus the neighbour divergence for embeddings), [examples] float64; layer-major where
        onloading proved it (`onload.passes`) unless the caller runs the blocks itself (`layer_major` False)."""
        shards = Shards(batches)  # data-parallel: this process's rows, every process's values
        outputs = passes(self.model, shards.local, self) if layer_major else map(self, shards.local)
        runs = zip(outputs, shards.local, shards.mine(targets))
        return objective.heldout(((out, b, on_device_of(t, b)) for out, b, t in runs), shards.gathered)

    def compensation(self, plan: dict[str, list[int]], means: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """FLAP's bias compensation: per pruned layer, the removed heads' mean contribution to the output,
        W_o[:, removed channels] @ mean[removed channels] (means over the unpruned calibration tokens)."""
        biases = {}
        for layer, mean in zip(self.layers, means):
            removed = [layer.heads.index(h) for h in plan.get(layer.name, ())]
            if removed:
                cols = head_features(removed, layer.head_dim, torch.device("cpu"))
                weight = output_projection(layer).matrix().detach().double().cpu()  # [out, inner]
                biases[layer.name] = (weight[:, cols] @ mean[cols]).float()
        return biases

    def prove(self, plan: dict[str, list[int]], inputs: dict | None = None) -> None:
        """Prove the plan and the state's sharing exact on copies of their layers (`probe_plan`,
        `prove_sharing`, on `inputs`; call it outside the hooks). A refused plan leaves the model as it was; a
        proven one is committed to: the output projections' originals are dropped, and `fold` removes its heads
        and shares the KV heads without proving them again."""
        layers = find_attention(self.model)
        try:
            normalized = normalize_plan(layers, plan)
            probe_plan(self.model, layers, normalized, inputs)
            if self.sharing:
                prove_sharing(self.model, self.sharing, self.key_maps, inputs)
        except BaseException:
            self.restore()
            raise
        self._originals.clear()
        self._proven = ({k: list(v) for k, v in plan.items()}, normalized)

    def fold(self, plan: dict[str, list[int]], inputs: dict | None = None) -> None:
        """Make the gated state permanent: updates and scales into the output projections, added biases into
        their biases (created and recorded where missing), then the plan's heads removed and the state's KV heads
        shared. A plan not yet proven is proven first (`prove`), so a refused plan leaves the model as it was."""
        if self._proven is None or self._proven[0] != plan:
            self.prove(plan, inputs)
        assert self._proven is not None
        plan = self._proven[1]
        with torch.no_grad():
            for layer, (down, up) in zip(self.layers, self.updates):
                weight = output_projection(layer).matrix()
                weight += (up.double() @ down.double()).to(weight.device, weight.dtype)
            for layer, scale in zip(self.layers, self.scales):
                if not torch.equal(scale, torch.ones_like(scale)):
                    fold_gates(layer, scale)
        add_output_bias(self.model, {l.name: b.detach() for l, b in zip(self.layers, self.biases) if b.any()})
        remove_proven(self.model, find_attention(self.model), plan)  # folding scales and biases keeps it exact
        if self.sharing:  # in layers the plan leaves whole: their original heads, as proven
            apply_sharing(self.model, self.sharing, self.key_maps)
