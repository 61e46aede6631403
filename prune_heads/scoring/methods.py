"""Head importance: score every head of a model on an evaluation set.

Methods are registered in `METHODS`; each takes a `ScoringRun` (the model, its layers, the batches, the
objective) and returns per-layer scores (higher = more important) and, where it has them, per-example
variances. The gradient family (gradient, taylor, fisher) shares one pass with per-example gates
[batch, heads]: one backward pass gives every example's dL/dgate.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sized
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import DEFAULT_METHOD
from ..errors import ConfigError
from ..model.gates import head_gates
from ..model.hooks import hooks
from ..model.layers import AttentionLayer, Projection, qkv_parts, require_attention, resolve
from ..runtime.devices import input_device, to_device
from ..runtime.memory import release_freed_memory
from ..runtime.parallel import distributed, rank_and_size, sum_across
from ..runtime.progress import progress_bar
from ..task_data import TaskData, batch_size, with_targets
from .head_scores import HeadScores
from .objective import Loss, Objective, encoder_probe, frozen
from .recording import Recorder


@dataclass
class ScoringRun:
    """What a scoring method works with."""

    model: nn.Module
    layers: list[AttentionLayer]
    batches: Iterable[dict]
    objective: Objective
    device: torch.device
    autocast: torch.dtype | None
    generator: torch.Generator
    progress: bool
    seed: int = 0
    examples: int = 0
    meta: dict = field(default_factory=dict)

    def iterate(self, desc: str) -> Iterator[dict]:
        """This process's batches (every one, or every N-th of N data-parallel processes) moved to the device,
        with a progress bar. The sampling generator is re-seeded per batch, so the scores do not depend on how
        the batches are shared out; freed memory goes back to the system after each one. Once all are seen,
        `examples` holds the count over all processes."""
        rank, size = rank_and_size()
        total = -(-(len(self.batches) - rank) // size) if isinstance(self.batches, Sized) else None
        self.examples = 0
        mine = itertools.islice(enumerate(self.batches), rank, None, size)
        for index, batch in progress_bar(mine, desc, total, self.progress and rank == 0):
            self.generator.manual_seed(self.seed * 1_000_003 + index)
            self.examples += batch_size(batch)
            yield to_device(batch, self.device)
            release_freed_memory()
        self.examples = int(sum_across([torch.tensor(float(self.examples))])[0])

    def forward(self, batch: dict):
        ctx = torch.autocast(self.device.type, self.autocast) if self.autocast else nullcontext()
        with ctx:
            return self.model(**self.objective.inputs(batch))


METHODS: dict[str, Callable[[ScoringRun], tuple[list[torch.Tensor], list[torch.Tensor] | None]]] = {}
PASSES: dict[str, Callable[[list[AttentionLayer]], int]] = {}  # a method's forward passes' worth over the batches


def method(name: str, passes: int | Callable[[list[AttentionLayer]], int] = 2):
    """Register a scoring method under `name` (a function ScoringRun -> (scores, variances or None)) with
    its cost over the batches in forward passes (`passes`, or a function of the layers; a backward pass through
    the gates counts as one more), what the flow's counted work prices it at. A name registered already is
    refused (as peft's `register_peft_method` refuses one)."""

    def register(fn):
        if name in METHODS:
            raise ConfigError(f"a scoring method named {name!r} is registered already; register yours under another")
        METHODS[name] = fn
        PASSES[name] = passes if callable(passes) else lambda layers: passes
        return fn

    return register


def scoring_passes(name: str, layers: list[AttentionLayer]) -> int:
    """The forward passes' worth over the batches that method `name` runs on a model with `layers`."""
    return PASSES[name](layers)


def gate_gradients(run: ScoringRun) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], int]:
    """One pass with per-example gates: per layer, the sums of g, |g| and g^2 over examples (float64) and n.

    Also leaves each layer's Fisher block, the sum of g g^T, in `run.meta["fisher_blocks"]`.
    """
    sums = [[torch.zeros(l.num_heads, dtype=torch.float64) for l in run.layers] for _ in range(3)]
    blocks = [torch.zeros(l.num_heads, l.num_heads, dtype=torch.float64) for l in run.layers]
    count = 0
    with head_gates(run.model) as gates:
        for batch in run.iterate("scoring heads"):
            n = batch_size(batch)
            per_example = run.objective.custom is None
            gates.reset(batch_size=n if per_example else None)
            losses = run.objective.per_example(run.forward(batch), batch, run.generator)
            grads = torch.autograd.grad(losses.sum(), list(gates), allow_unused=True)
            for i, grad in enumerate(grads):
                g = (torch.zeros_like(gates[i]) if grad is None else grad).detach().double().cpu()
                g = g if per_example else g.unsqueeze(0)
                sums[0][i] += g.sum(0)
                sums[1][i] += g.abs().sum(0)
                sums[2][i] += (g**2).sum(0)
                blocks[i] += g.T @ g
            count += n if per_example else 1
    n = len(run.layers)
    *summed, total = sum_across([*sums[0], *sums[1], *sums[2], *blocks, torch.tensor(float(count))])
    run.meta["fisher_blocks"] = {l.name: b.tolist() for l, b in zip(run.layers, summed[3 * n :])}
    return summed[:n], summed[n : 2 * n], summed[2 * n : 3 * n], int(total)


def _variance(total: torch.Tensor, total_sq: torch.Tensor, n: int) -> torch.Tensor:
    mean = total / max(n, 1)
    return (total_sq / max(n, 1) - mean**2).clamp(min=0) * n / max(n - 1, 1)


@method("gradient")
def gradient_importance(run: ScoringRun):
    """Michel et al. (2019): E_x |dL(x)/dgate|, per example."""
    _, abs_sum, sq_sum, n = gate_gradients(run)
    return [a / n for a in abs_sum], [_variance(a, s, n) for a, s in zip(abs_sum, sq_sum)]


@method("taylor")
def taylor_importance(run: ScoringRun):
    """Molchanov et al. (2017): |E_x dL(x)/dgate|, the first-order estimate of the loss change on removal."""
    total, _, sq_sum, n = gate_gradients(run)
    return [t.abs() / n for t in total], [_variance(t, s, n) for t, s in zip(total, sq_sum)]


@method("fisher")
def fisher_importance(run: ScoringRun):
    """Kwon et al. (2022): sum over examples of (dL(x)/dgate)^2, the diagonal of the empirical Fisher."""
    _, _, sq_sum, _ = gate_gradients(run)
    return sq_sum, None


@method("activation", passes=1)
def activation_importance(run: ScoringRun):
    """Mean L2 norm of each head's contribution to the layer output (its slice through the output projection)."""
    totals = [torch.zeros(l.num_heads, dtype=torch.float64) for l in run.layers]
    counts = [0] * len(run.layers)

    def hook_for(i: int, layer: AttentionLayer):
        o_proj = resolve(layer.module, layer.spec.o)

        def hook(module, args):
            heads = args[0].detach().float().reshape(-1, layer.num_heads, layer.head_dim)  # [tokens, heads, dim]
            weight = Projection(o_proj).matrix().detach().float()
            per_head = weight.reshape(weight.shape[0], layer.num_heads, layer.head_dim)  # [out, heads, dim]
            contribution = torch.einsum("thd,ohd->tho", heads, per_head).norm(dim=-1)  # [tokens, heads]
            totals[i] += contribution.sum(0).double().cpu()
            counts[i] += contribution.shape[0]

        return o_proj, "forward_pre", hook

    with hooks(hook_for(i, layer) for i, layer in enumerate(run.layers) if layer.num_heads), torch.no_grad():
        for batch in run.iterate("head activations"):
            run.forward(batch)
    summed = sum_across([*totals, torch.tensor(counts, dtype=torch.float64)])
    return [t / max(float(c), 1) for t, c in zip(summed[:-1], summed[-1])], None


@method("magnitude", passes=0)
def magnitude_importance(run: ScoringRun):
    """Data-free: ||W_v of the head's KV group||_F * ||W_o columns of the head||_F (the OV path's scale)."""
    scores = []
    for layer in run.layers:
        spec, module, dim = layer.spec, layer.module, layer.head_dim
        o_in = Projection(resolve(module, spec.o)).matrix().detach().float().t()  # [in, out]
        o_norm = o_in.reshape(layer.num_heads, dim, -1).flatten(1).norm(dim=1)
        slot = qkv_parts(module, spec, layer.num_heads, dim)[0]["v"]
        rows = slot.features(list(range(layer.num_kv_heads)), dim)
        v = slot.projection.matrix().detach().float()[rows.to(slot.projection.module.weight.device)]  # [kv * dim, in]
        v_norm = v.reshape(layer.num_kv_heads, -1).norm(dim=1)
        group_of = [layer.kv_heads.index(h // layer.group_size) for h in layer.heads]
        scores.append((o_norm * v_norm[group_of]).double().cpu())
    return scores, None


def fluctuation(layers: list[AttentionLayer], variances: list[torch.Tensor], groups: bool = True) -> list[torch.Tensor]:
    """FLAP (An et al. 2024): the fluctuation of a structure is the sum over its output-projection input
    channels of the channel's variance over the calibration tokens times the squared norm of its column,
    standardised within each layer (zero mean, unit variance) so that layers compare. With `groups`, the
    structures of a grouped-query layer are its KV groups (what selection then removes; each head carries its
    share of its group's value), else single heads."""
    scores = []
    for layer, variance in zip(layers, variances):
        weight = Projection(resolve(layer.module, layer.spec.o)).matrix().detach().double().cpu()  # [out, inner]
        head = (variance.double() * (weight * weight).sum(0)).reshape(layer.num_heads, layer.head_dim).sum(-1)
        owner = torch.tensor([h // layer.group_size if groups else h for h in layer.heads])
        _, unit = torch.unique(owner, return_inverse=True)  # [heads] -> index of its structure
        value = torch.zeros(int(unit.max()) + 1 if len(unit) else 0, dtype=torch.float64).index_add(0, unit, head)
        spread = value.std() if len(value) > 1 else value.new_tensor(0.0)
        standard = (value - value.mean()) / spread if spread > 0 else torch.zeros_like(value)
        size = torch.bincount(unit).double()
        scores.append((standard / size)[unit])
    return scores


@method("fluctuation", passes=1)
def fluctuation_importance(run: ScoringRun):
    """Forward only: FLAP's fluctuation of each head's output channels (see `fluctuation`)."""
    with Recorder(run.model, run.layers, run.objective) as recorder, torch.no_grad():
        for batch in run.iterate("head fluctuation"):
            run.forward(batch)
    recorder.reduce()
    return fluctuation(run.layers, recorder.variances()), None


@method("ablation", passes=lambda layers: 1 + sum(l.num_heads for l in layers))
def ablation_importance(run: ScoringRun):
    """Exact: the mean increase of the objective when the head alone is removed (gate 0)."""
    increases = [torch.zeros(l.num_heads, dtype=torch.float64) for l in run.layers]
    with head_gates(run.model, requires_grad=False) as gates, torch.no_grad():
        for batch in run.iterate("ablating heads"):
            outputs = run.forward(batch)
            reference = None if run.objective.has_labels(batch) else run.objective.reference(outputs, batch)
            base = run.objective.value(outputs, batch, reference).double().sum().cpu()
            for i, layer in enumerate(run.layers):
                for h in range(layer.num_heads):
                    gates[i][h] = 0.0
                    value = run.objective.value(run.forward(batch), batch, reference).double().sum().cpu()
                    increases[i][h] += value - base
                    gates[i][h] = 1.0
    return [inc / max(run.examples, 1) for inc in sum_across(increases)], None


@method("random", passes=0)
def random_importance(run: ScoringRun):
    """A seeded random baseline."""
    return [torch.rand(l.num_heads, generator=run.generator, dtype=torch.float64) for l in run.layers], None


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """torch's global generators seeded with `seed` inside (draws outside `ScoringRun.generator`), as they were
    again on exit."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def score_heads(
    model: nn.Module,
    dataloader: Iterable[dict],
    method: str = DEFAULT_METHOD,
    loss: Loss | None = None,
    device: str | torch.device | None = None,
    normalize: bool | None = None,
    seed: int = 0,
    autocast: torch.dtype | None = None,
    progress: bool = True,
) -> HeadScores:
    """Measure the importance of every present head of `model` on the batches of `dataloader`.

    Batches are dicts of tensors as the model takes them (with `labels` where the task has them). `loss=None`
    uses the model's task loss with labels (for an encoder without a head, that of a logistic regression
    fitted on its embeddings of the labelled batches: a feature-extraction `TaskData`'s targets are used so),
    and without labels the divergence from the ungated model (see Objective). Methods: see `METHODS`
    (gradient, taylor, fisher, activation, magnitude, ablation, random).
    Parameters are frozen while scoring (only gate gradients are computed) and restored after. `normalize`
    (default: on for gradient, as Michel et al.) divides each layer's scores by their L2 norm. `device`
    moves the model there (leave it unset for a model loaded with `device_map`, layers on several devices or
    offloaded); `autocast` (e.g. torch.bfloat16) runs the forward under autocast; gates stay float32 in a
    bf16/fp16 model and scores are accumulated in float64 and returned as float32. Deterministic for a given
    seed. Under `accelerate launch` each process scores its share of the batches and every process gets
    the scores of all of them (see `prune_heads.parallel`).
    The caller's random state is left as it was (the draws inside are seeded).
    """
    if method not in METHODS:
        raise ConfigError(f"unknown scoring method {method!r}; choose one of {', '.join(sorted(METHODS))}")
    target = _placed(model, device)
    layers = require_attention(model)
    generator = torch.Generator().manual_seed(seed)
    if isinstance(dataloader, TaskData):
        dataloader = with_targets(dataloader)
    with _seeded(seed), frozen(model):
        probe = encoder_probe(model, dataloader, target) if loss is None else None
        run = ScoringRun(
            model=model,
            layers=layers,
            batches=dataloader,
            objective=Objective(model, loss, probe),
            device=target,
            autocast=autocast,
            generator=generator,
            progress=progress,
            seed=seed,
        )
        scores, variances = METHODS[method](run)
    normalized = bool(normalize if normalize is not None else method == "gradient")
    if normalized:
        scores, variances = _per_layer_unit_norm(scores, variances)
    meta = {"normalized": normalized, "seed": seed, **run.meta}
    return head_scores(method, layers, scores, run.examples, variances, meta)


def _placed(model: nn.Module, device: str | torch.device | None) -> torch.device:
    """The device scoring feeds: `device` (the model moved there; a process's own GPU under accelerate
    launch), else where the model takes its inputs."""
    state = distributed()
    if device is None and state is not None and state.device.type != "cpu":
        device = state.device  # one GPU per process
    if device is None:
        return input_device(model)
    if hasattr(model, "hf_device_map"):
        raise ConfigError("the model was loaded with a device_map, which already placed it; leave device unset")
    model.to(device)
    return torch.device(device)


def _per_layer_unit_norm(scores: list[torch.Tensor], variances: list[torch.Tensor] | None):
    """Each layer's scores over their L2 norm (Michel et al.), their variances over its square."""
    norms = [s.norm() for s in scores]
    scaled = [s / n if n > 0 else s for s, n in zip(scores, norms)]
    return scaled, None if variances is None else [v / n**2 if n > 0 else v for v, n in zip(variances, norms)]


def head_scores(
    method: str,
    layers: list[AttentionLayer],
    scores: list[torch.Tensor],
    num_examples: int,
    variances: list[torch.Tensor] | None = None,
    meta: dict | None = None,
) -> HeadScores:
    """`HeadScores` from per-layer values over the layers' present heads (float32, keyed by layer name)."""
    names = [l.name for l in layers]
    return HeadScores(
        method=method,
        num_examples=num_examples,
        scores={n: s.float() for n, s in zip(names, scores)},
        heads={l.name: l.heads for l in layers},
        group_sizes={l.name: l.group_size for l in layers},
        original_heads={l.name: l.original_num_heads for l in layers},
        variance=None if variances is None else {n: v.float() for n, v in zip(names, variances)},
        meta=meta or {},
    )
