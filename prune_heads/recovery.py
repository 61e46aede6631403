"""Retraining-free recovery after head removal, and the machinery to decide it on held-out data.

- `GatedModel`: the unpruned model with a gate per head and an added bias per output projection (hooks),
  so candidate plans, bias compensation and tuning are tried without copying or changing a weight; gate 0
  is exactly the head's removal, so what is measured here is what `prune` then produces.
- `Recorder`: watches the unpruned model's forward passes while it is scored: per output-projection input
  channel its mean and variance over the calibration tokens (FLAP's statistics, An et al. 2024) and the
  compact reference outputs the tuning matches.
- `tune`: Adam over head scales and output biases against the unpruned outputs (KL on logits, 1 - cosine of
  pooled embeddings), stopping when a held-out check (of the last step and of the moving average of the
  steps, the lower counting) stops improving; `tune_gates` is its form for a pruned model and a separate
  unpruned reference.
- `reconstruct`: mask tuning (Kwon et al. 2022) and bias compensation as one least-squares problem per layer
  against a separate unpruned reference, folded into the output projection.
"""

from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterable, Iterator, NamedTuple

import torch
from torch import nn

from .data import batch_size, input_device, to_device, without_labels
from .gates import head_gates
from .hooks import hooks
from .layers import AttentionLayer, Projection, find_attention, resolve
from .memory import release_freed_memory
from .objective import Objective, frozen
from .parallel import sum_across
from .probe import probe_plan, remove_proven
from .surgery import add_output_bias, head_features, normalize_plan
from .work import Budget


def _rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Token rows [tokens, features] of a [batch, seq, features] activation, padding (mask 0) dropped."""
    if mask is not None and x.dim() == 3 and mask.shape == x.shape[:2]:
        return x[mask.bool()]
    return x.reshape(-1, x.shape[-1])


class _Statistics:
    """Sums over calibration tokens of x x^T, x y^T, x, y and |y|^2 for one layer, where x is the pruned
    layer's output-projection input and y the unpruned layer's output-projection output."""

    def __init__(self, inner: int, width: int) -> None:
        self.C = torch.zeros(inner, inner, dtype=torch.float64)
        self.P = torch.zeros(inner, width, dtype=torch.float64)
        self.sx, self.sy = torch.zeros(inner, dtype=torch.float64), torch.zeros(width, dtype=torch.float64)
        self.yy, self.n = 0.0, 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.double().cpu(), y.double().cpu()
        self.C += x.T @ x
        self.P += x.T @ y
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.yy += float((y * y).sum())
        self.n += y.shape[0]


@torch.no_grad()
def _collect(model: nn.Module, reference: nn.Module, pairs: list[tuple[AttentionLayer, AttentionLayer]],
             batches: list[dict]) -> list[_Statistics]:
    """One forward of each model per batch, with hooks on the output projections of every layer in `pairs`."""
    stats = [_Statistics(l.num_heads * l.head_dim, _output(l).features("out")) for l, _ in pairs]
    xs: dict[int, torch.Tensor] = {}
    ys: dict[int, torch.Tensor] = {}
    watch = [(resolve(l.module, l.spec.o), "forward_pre", lambda m, a, i=i: xs.__setitem__(i, a[0].detach()))
             for i, (l, _) in enumerate(pairs)]
    watch += [(resolve(r.module, r.spec.o), "forward", lambda m, a, out, i=i: ys.__setitem__(i, out.detach()))
              for i, (_, r) in enumerate(pairs)]
    with hooks(watch):
        for batch in batches:
            xs.clear()
            ys.clear()
            reference(**batch)
            model(**batch)
            for i, (layer, _) in enumerate(pairs):
                y = _rows(ys[i], batch.get("attention_mask"))
                x = _rows(xs[i], batch.get("attention_mask")) if layer.num_heads else y.new_zeros(y.shape[0], 0)
                stats[i].add(x, y)
    return stats


def _output(layer: AttentionLayer) -> Projection:
    """The layer's output projection (the one that consumes the concatenated heads)."""
    return Projection(resolve(layer.module, layer.spec.o))


def _fold_scales(layer: AttentionLayer, scales: torch.Tensor) -> None:
    """Multiply each kept head's output-projection columns by its scale (exact: gates are linear there)."""
    _output(layer).scale_inputs(scales.repeat_interleave(layer.head_dim))


@torch.no_grad()
def _solve(layer: AttentionLayer, s: _Statistics, scales: bool, bias: bool, ridge: float) -> dict[str, float]:
    """Fit the kept heads' scales and/or the output bias to the statistics, and fold them into the layer."""
    o_proj = resolve(layer.module, layer.spec.o)
    W = _output(layer).matrix().detach().double().cpu()  # [width, inner]
    width, dim, heads = W.shape[0], layer.head_dim, layer.num_heads
    inner, n = heads * dim, max(s.n, 1)
    b_old = o_proj.bias.detach().double().cpu() if o_proj.bias is not None else torch.zeros(width, dtype=torch.float64)
    Wh = W.reshape(width, heads, dim)  # [width, heads, dim]: head h's columns are Wh[:, h]

    def error(m: torch.Tensor, b: torch.Tensor) -> float:
        """Mean over tokens of ||sum_h m_h A_h + b - y||^2, from the statistics."""
        Wm = (Wh * m[None, :, None]).reshape(width, inner)
        return float((Wm @ s.C * Wm).sum() - 2 * (s.P * Wm.T).sum() + s.yy + s.n * b @ b + 2 * b @ (Wm @ s.sx)
                     - 2 * b @ s.sy) / n

    ones = torch.ones(heads, dtype=torch.float64)
    before = error(ones, b_old)
    can_bias = bias and o_proj.bias is not None
    m = ones
    if scales and heads:
        # with a free bias the statistics are centred (the bias absorbs the means); else the old bias is fixed
        Cc, Pc = (s.C - torch.outer(s.sx, s.sx) / n, s.P - torch.outer(s.sx, s.sy) / n) if can_bias else \
            (s.C, s.P - torch.outer(s.sx, b_old))  # Cc: [inner, inner], Pc: [inner, width]
        # normal equations in the scales m: G m = r, G[i, j] = <W_i x_i, W_j x_j>, r[i] = <W_i x_i, y>
        G = torch.einsum("idje,aid,aje->ij", Cc.reshape(heads, dim, heads, dim), Wh, Wh)  # [heads, heads]
        r = torch.einsum("ida,aid->i", Pc.reshape(heads, dim, width), Wh)  # [heads]
        lam = ridge * float(G.diagonal().mean()) + 1e-12
        m = torch.linalg.solve(G + lam * torch.eye(heads, dtype=torch.float64), r + lam * ones)
    b = b_old
    if can_bias:
        b = (s.sy - (Wh * m[None, :, None]).reshape(width, inner) @ s.sx) / n
    after = error(m, b)
    _fold_scales(layer, m)
    if can_bias:
        o_proj.bias.copy_(b.to(o_proj.bias.dtype))
    return {"error_before": before, "error_after": after, "tokens": s.n, "scales": m.tolist()}


def reconstruct(model: nn.Module, reference: nn.Module, dataloader: Iterable[dict], scales: bool = True,
                bias: bool = True, ridge: float = 1e-3, sequential: bool = False) -> dict[str, dict[str, float]]:
    """Rescale the kept heads (`scales`, mask tuning) and/or reset the output bias (`bias`, bias compensation)
    of every pruned layer so that its output matches the unpruned `reference` model's on the calibration
    batches, in place. `ridge` pulls the scales towards 1 (relative to the mean head energy). With
    `sequential`, layers are fitted one after another, each on inputs that include the earlier fits (one
    pass per layer); otherwise all layers are fitted from one pass.

    Returns, per layer, the mean squared reconstruction error per token before and after. Bias
    compensation needs an output projection with a bias (BERT-likes, GPT-2, OPT, ViT, ...); layers without
    one get scales only. `model` is the pruned copy of `reference`.
    """
    device = input_device(model)
    batches = [to_device(without_labels(b), device) for b in dataloader]
    layers, ref_layers = find_attention(model), {l.name: l for l in find_attention(reference)}
    was_training = (model.training, reference.training)
    model.eval()
    reference.eval()
    pairs = [(l, ref_layers[l.name]) for l in layers if l.num_heads < l.original_num_heads]
    report = {}
    try:
        for group in ([[p] for p in pairs] if sequential else [pairs]):
            for (layer, _), stats in zip(group, _collect(model, reference, group, batches)):
                report[layer.name] = _solve(layer, stats, scales, bias, ridge)
    finally:
        model.train(was_training[0])
        reference.train(was_training[1])
    return report


class Recorder:
    """Hooks that watch forward passes of the unpruned model: per attention layer, the sum and squared sum
    over tokens of every output-projection input channel (padding left out), and per pass the compact
    reference outputs (`Objective.reference`, on the CPU). Use it around the scoring pass so the statistics
    cost no extra forward; `calls` tells whether it saw one plain pass per batch."""

    def __init__(self, model: nn.Module, layers: list[AttentionLayer], objective: Objective) -> None:
        self.model, self.layers, self.objective = model, layers, objective
        self.sums = [torch.zeros(l.num_heads * l.head_dim, dtype=torch.float64) for l in layers]
        self.squares = [torch.zeros(l.num_heads * l.head_dim, dtype=torch.float64) for l in layers]
        self.tokens = [0] * len(layers)
        self.targets: list = []
        self.calls = 0
        self._mask: torch.Tensor | None = None
        self._stack = ExitStack()

    def __enter__(self) -> "Recorder":
        watch = [(self.model, "forward_pre", self._inputs), (self.model, "forward", self._outputs)]
        watch += [(resolve(l.module, l.spec.o), "forward_pre", self._channels(i)) for i, l in enumerate(self.layers)]
        self._stack.enter_context(hooks(watch, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _inputs(self, module, args, kwargs) -> None:
        self._mask = kwargs.get("attention_mask")

    def _outputs(self, module, args, kwargs, outputs) -> None:
        self.calls += 1
        target = self.objective.reference(outputs, kwargs)
        self.targets.append(tuple(t.cpu() for t in target) if isinstance(target, tuple) else target.cpu())

    def _channels(self, i: int):
        def hook(module, args, kwargs) -> None:
            x = _rows(args[0].detach(), self._mask).double().cpu()  # [tokens, heads * head_dim]
            self.sums[i] += x.sum(0)
            self.squares[i] += (x * x).sum(0)
            self.tokens[i] += x.shape[0]

        return hook

    def reduce(self) -> None:
        """Sum the statistics over data-parallel processes (a no-op in a single process)."""
        n = len(self.layers)
        summed = sum_across([*self.sums, *self.squares, torch.tensor(self.tokens, dtype=torch.float64)])
        self.sums, self.squares = summed[:n], summed[n:2 * n]
        self.tokens = [int(t) for t in summed[-1].tolist()]

    def means(self) -> list[torch.Tensor]:
        """Per layer, each output-projection input channel's mean over the recorded tokens."""
        return [s / max(n, 1) for s, n in zip(self.sums, self.tokens)]

    def variances(self) -> list[torch.Tensor]:
        """Per layer, each output-projection input channel's variance over the recorded tokens."""
        return [(q / max(n, 1) - m * m).clamp(min=0) for q, n, m in zip(self.squares, self.tokens, self.means())]


@torch.no_grad()
def record(model: nn.Module, batches: list[dict], objective: Objective) -> Recorder:
    """A `Recorder` filled by one plain no-grad pass over the batches."""
    with frozen(model), Recorder(model, find_attention(model), objective) as recorder:
        for batch in batches:
            model(**batch)
            release_freed_memory()
    return recorder


class GatedModel:
    """The model with a gate per head (`scales` x `masks`) and an added bias per output projection
    (`biases`), all hooks: call it on a batch to run the gated model. Plans are tried by zeroing masks; gate
    0 gives exactly the outputs of the model with that head removed, and `fold` makes it so."""

    def __init__(self, model: nn.Module, layers: list[AttentionLayer]) -> None:
        self.model, self.layers = model, layers
        projections = [_output(l) for l in layers]
        self.devices = [p.module.weight.device for p in projections]
        self.widths = [p.features("out") for p in projections]
        self.use({})
        self._stack = ExitStack()

    def use(self, plan: dict[str, list[int]], biases: dict[str, torch.Tensor] | None = None) -> None:
        """Gates of 0 for the plan's heads and 1 for the others, and the given added biases (else none)."""
        removed = [set(plan.get(l.name, ())) for l in self.layers]
        self.masks = [torch.tensor([0.0 if h in r else 1.0 for h in l.heads], device=d)
                      for l, r, d in zip(self.layers, removed, self.devices)]
        self.scales = [torch.ones(l.num_heads, device=d) for l, d in zip(self.layers, self.devices)]
        self.biases = [(biases or {}).get(l.name, torch.zeros(w)).float().to(d).clone()
                       for l, w, d in zip(self.layers, self.widths, self.devices)]

    def __enter__(self) -> "GatedModel":
        self.gates = self._stack.enter_context(head_gates(self.model, requires_grad=False))
        add = [(resolve(l.module, l.spec.o), "forward", self._add_bias(i)) for i, l in enumerate(self.layers)]
        self._stack.enter_context(hooks(add))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _add_bias(self, i: int):
        return lambda module, args, out: out + self.biases[i].to(out.dtype)

    def __call__(self, batch: dict):
        for i, (scale, mask) in enumerate(zip(self.scales, self.masks)):
            self.gates[i] = scale * mask
        return self.model(**batch)

    @torch.no_grad()
    def divergences(self, batches: list[dict], targets: list, objective: Objective) -> torch.Tensor:
        """Per-example held-out values of the gated model against the targets (`Objective.heldout`: the
        divergence, plus the neighbour divergence for embeddings), [examples] float64."""
        return objective.heldout((self(b), b, _to(t, b)) for b, t in zip(batches, targets))

    def compensation(self, plan: dict[str, list[int]], means: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """FLAP's bias compensation: per pruned layer, the removed heads' mean contribution to the output,
        W_o[:, removed channels] @ mean[removed channels] (means over the unpruned calibration tokens)."""
        biases = {}
        for layer, mean in zip(self.layers, means):
            removed = [layer.heads.index(h) for h in plan.get(layer.name, ())]
            if removed:
                cols = head_features(removed, layer.head_dim, torch.device("cpu"))
                weight = _output(layer).matrix().detach().double().cpu()  # [out, inner]
                biases[layer.name] = (weight[:, cols] @ mean[cols]).float()
        return biases

    def fold(self, plan: dict[str, list[int]], inputs: dict | None = None) -> None:
        """Make the gated state permanent: scales into the output projections, added biases into their biases
        (created and recorded where missing), then the plan's heads removed. The plan is proven on copies
        first (`probe_plan`, on `inputs`), so a refused plan leaves the model as it was."""
        layers = find_attention(self.model)
        plan = normalize_plan(layers, plan)
        probe_plan(self.model, layers, plan, inputs)
        with torch.no_grad():
            for layer, scale in zip(self.layers, self.scales):
                if not torch.equal(scale, torch.ones_like(scale)):
                    _fold_scales(layer, scale)
        add_output_bias(self.model, {l.name: b.detach() for l, b in zip(self.layers, self.biases) if b.any()})
        remove_proven(self.model, layers, plan)  # proven above; folding scales and biases keeps it exact


def _to(target, batch: dict):
    """A target (tensor or tuple of tensors) on the device of the batch's tensors."""
    device = next(v.device for v in batch.values() if torch.is_tensor(v))
    return tuple(t.to(device) for t in target) if isinstance(target, tuple) else target.to(device)


PATIENCE = 2  # epochs without a better held-out value before tuning stops
AVERAGE = 0.9  # decay per step of the moving average that tuning checks beside its last step
MIN_TUNING_FLOPS = 6e12  # tuning always gets this much work (about a minute on 2 CPU cores): small models tune fully


def _copy(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of the parameters' current values."""
    return [p.detach().clone() for p in params]


@torch.no_grad()
def _load(params: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Put `values` into the parameters, in place."""
    for p, value in zip(params, values):
        p.copy_(value)


class _Average:
    """An exponential moving average of parameters over optimizer steps (Polyak averaging), bias-corrected
    so the first steps are not pulled towards zero: `values()` is the average, `applied()` puts it in the
    parameters' place for a while (to check it), `reset()` starts a new average from the next step."""

    def __init__(self, params: list[torch.Tensor], decay: float) -> None:
        self.params, self.decay = params, decay
        self.reset()

    def reset(self) -> None:
        self.sums = [torch.zeros_like(p) for p in self.params]
        self.weight = 0.0

    @torch.no_grad()
    def update(self) -> None:
        for total, p in zip(self.sums, self.params):
            total.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)
        self.weight = self.weight * self.decay + 1 - self.decay

    def values(self) -> list[torch.Tensor]:
        """The average so far (call only after a step: `weight` > 0)."""
        return [total / self.weight for total in self.sums]

    @contextmanager
    def applied(self) -> Iterator[None]:
        live = _copy(self.params)
        _load(self.params, self.values())
        try:
            yield
        finally:
            _load(self.params, live)


class Tuning(NamedTuple):
    """What `tune` did: the checked held-out values (the first before tuning), the steps taken, whether the
    parameters it left are the moving average of the steps (else the steps' own values), and the FLOPs it
    spent (0 without a budget to count them)."""

    history: list[float]
    steps: int
    averaged: bool
    flops: float = 0.0


def _readouts(check: Callable[[], float], params: list[torch.Tensor], averaged: _Average | None):
    """The held-out value and a copy of the parameters that give it, for the current parameters and (when
    averaging) their moving average, whichever checks lower; and whether that is the average."""
    options = [(check(), _copy(params), False)]
    if averaged is not None and averaged.weight:
        with averaged.applied():
            options.append((check(), averaged.values(), True))
    return min(options, key=lambda option: option[0])


def tune(forward: Callable[[dict], object], groups: list[dict], batches: list[dict], targets: list,
         objective: Objective, epochs: int, seed: int = 0, check: Callable[[], float] | None = None,
         budget: Budget | None = None, average: float = 0.0) -> Tuning:
    """Adam over the parameter `groups` so `forward`'s outputs match the targets (the objective's divergence),
    for `epochs` passes in a seeded order. With `average` in (0, 1), an exponential moving average of the
    parameters over the steps (that decay per step) is kept beside them: it smooths out Adam's step-to-step
    jitter. With `check` (a held-out divergence), it runs after every epoch, on the parameters and on their
    average, and the lower of the two counts: an epoch that does not improve on the best so far goes back
    to the best parameters and halves the learning rates, tuning stops after PATIENCE such epochs, and the
    best parameters are kept. Without `check`, the average (when kept) is what tuning leaves. With `budget`
    (counted FLOPs, never a clock), no step starts whose work and the final check's would pass its limit
    (the first step always runs); a cut epoch is checked like a whole one."""
    params = [p for group in groups for p in group["params"]]
    optimizer = torch.optim.Adam(groups)
    averaged = _Average(params, average) if average else None
    generator = torch.Generator().manual_seed(seed)
    history = [check()] if check else []
    checks = (2 if averaged else 1) if check else 0  # held-out passes per check after a step
    if budget is not None and check:
        budget.spent += budget.check
    best, best_averaged = _copy(params), False
    misses, steps, out_of_budget = 0, 0, False
    for _ in range(epochs):
        begun = steps
        for i in torch.randperm(len(batches), generator=generator).tolist():
            cost = budget.step(batches[i]) if budget is not None else 0.0
            if budget is not None and steps and not budget.allows(cost + checks * budget.check):
                out_of_budget = True
                break
            loss = objective.divergence(forward(batches[i]), batches[i], _to(targets[i], batches[i])).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            release_freed_memory()
            if averaged:
                averaged.update()
            steps += 1
            if budget is not None:
                budget.spent += cost
        if out_of_budget and steps == begun:  # nothing new to check
            break
        improved = False
        if check:
            value, values, from_average = _readouts(check, params, averaged)
            if budget is not None:
                budget.spent += checks * budget.check
            history.append(value)
            improved = value < min(history[:-1])
            if improved:
                best, best_averaged = values, from_average
        if out_of_budget:
            break
        if not check or improved:
            continue
        misses += 1
        if misses >= PATIENCE:
            break
        _load(params, best)  # back to the best point, with smaller steps
        if averaged:
            averaged.reset()
        for group in optimizer.param_groups:
            group["lr"] /= 2
    if not check and averaged and averaged.weight:
        best, best_averaged = averaged.values(), True
    if check or best_averaged:
        _load(params, best)
    optimizer.zero_grad(set_to_none=True)
    return Tuning(history, steps, best_averaged, budget.spent if budget is not None else 0.0)


def tune_gates(model: nn.Module, reference: nn.Module, dataloader: Iterable[dict], epochs: int = 2,
               lr: float = 0.05, seed: int = 0, bias_lr: float | None = None,
               average: float = AVERAGE) -> dict[str, list[float]]:
    """Tune one scale per kept head of a pruned `model` so its outputs match the unpruned `reference`
    model's, then fold the scales into the output projections (the model stays a plain smaller model).

    The objective is the label-free divergence (KL on logits, 1 - cosine of pooled embeddings) over the
    calibration batches, minimised with Adam over the head gates alone. With `bias_lr`, the output
    projections' biases (where they have one) are tuned too, at that learning rate (a learned bias
    compensation). `average` is the decay of the moving average of the tuned values that is kept (0: the
    last step's). `ph.prune_model` does the same on the gated unpruned model, with no second copy.
    Returns the scales per layer.
    """
    device = input_device(model)
    batches = [to_device(without_labels(b), device) for b in dataloader]
    objective = Objective(model)
    reference.eval()
    with torch.no_grad():
        targets = [objective.reference(reference(**b), b) for b in batches]
    layers = find_attention(model)
    biases = [b for b in (resolve(l.module, l.spec.o).bias for l in layers) if b is not None] if bias_lr else []
    with frozen(model), head_gates(model) as gates:  # frozen restores every requires_grad flag on exit
        for b in biases:
            b.requires_grad_(True)
        groups = [{"params": list(gates), "lr": lr}] + ([{"params": biases, "lr": bias_lr}] if biases else [])
        tune(lambda b: model(**b), groups, batches, targets, objective, epochs, seed, average=average)
        scales = _copy(gates)
    with torch.no_grad():
        for layer, scale in zip(layers, scales):
            if layer.num_heads:
                _fold_scales(layer, scale)
    return {layer.name: scale.tolist() for layer, scale in zip(layers, scales)}


def split_holdout(batches: list[dict], fraction: float) -> tuple[list[dict], list[dict]]:
    """(calibration, held-out) batches: every 1/fraction-th example across all batches is held out (a slice
    of its own batch, so no padding changes), so the held-out part spans the data the way batches of
    similar lengths do not. No hold-out for fraction 0 or fewer than two examples."""
    total = sum(batch_size(b) for b in batches)
    if fraction <= 0 or total < 2:
        return batches, []
    calib, held, seen = [], [], 0
    for batch in batches:
        rows = batch_size(batch)
        out = [r for r in range(rows) if math.floor((seen + r + 1) * fraction) > math.floor((seen + r) * fraction)]
        seen += rows
        keep = [r for r in range(rows) if r not in set(out)]
        for part, index in ((calib, keep), (held, out)):
            if index:
                part.append(_take_rows(batch, torch.tensor(index), rows))
    if not held or not calib:
        return batches, []
    return calib, held


def _take_rows(batch: dict, index: torch.Tensor, rows: int) -> dict:
    """The batch restricted to the rows in `index` (tensors whose first dimension is the batch)."""
    return {k: v.index_select(0, index.to(v.device)) if torch.is_tensor(v) and v.dim() and v.shape[0] == rows else v
            for k, v in batch.items()}
