"""Head importance: score every head of a model on an evaluation set.

Methods are registered in `METHODS`; each takes a `ScoringRun` (the model, its layers, the batches, the
objective) and returns per-layer scores (higher = more important) and, where it has them, per-example
variances. The gradient family (gradient, taylor, fisher) shares one pass with per-example gates
[batch, heads]: one backward pass gives every example's dL/dgate.
"""

from __future__ import annotations

import itertools
import json
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from .data import input_device, to_device
from .gates import head_gates
from .layers import AttentionLayer, find_attention, resolve, weight_matrix
from .parallel import distributed, rank_and_size, sum_across

Loss = Callable[[object, dict], torch.Tensor]


@dataclass
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

        return {"method": self.method, "num_examples": self.num_examples, "scores": lists(self.scores),
                "heads": {k: list(v) for k, v in self.heads.items()}, "group_sizes": self.group_sizes,
                "original_heads": self.original_heads, "variance": lists(self.variance), "meta": self.meta}

    @classmethod
    def from_dict(cls, data: dict) -> "HeadScores":
        """Inverse of `to_dict`."""
        def tensors(lists):
            return None if lists is None else {k: torch.tensor(v, dtype=torch.float32) for k, v in lists.items()}

        return cls(data["method"], data["num_examples"], tensors(data["scores"]),
                   {k: tuple(v) for k, v in data["heads"].items()}, data["group_sizes"], data["original_heads"],
                   tensors(data.get("variance")), data.get("meta", {}))

    def save(self, path: str | Path) -> None:
        """Write the scores as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "HeadScores":
        """Read scores written by `save`."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def matrix(self) -> torch.Tensor:
        """[layers, max original heads] with NaN where a head is absent (removed or beyond the layer)."""
        width = max(self.original_heads.values())
        grid = torch.full((len(self.scores), width), float("nan"))
        for row, name in enumerate(self.scores):
            grid[row, list(self.heads[name])] = self.scores[name]
        return grid

    def plot(self, path: str | Path, removed: dict[str, list[int]] | None = None, title: str | None = None) -> Path:
        """Save a layers x heads heatmap PNG; heads in `removed` are crossed out, absent heads are blank."""
        from .report import heatmap

        return heatmap(self, Path(path), removed or {}, title)


@dataclass
class ScoringRun:
    """What a scoring method works with."""

    model: nn.Module
    layers: list[AttentionLayer]
    batches: Iterable[dict]
    objective: "Objective"
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
        the batches are shared out. Once all are seen, `examples` holds the count over all processes."""
        rank, size = rank_and_size()
        total = -(-(len(self.batches) - rank) // size) if hasattr(self.batches, "__len__") else None
        self.examples = 0
        mine = itertools.islice(enumerate(self.batches), rank, None, size)
        for index, batch in tqdm(mine, desc=desc, total=total, disable=not self.progress or rank > 0, leave=False):
            self.generator.manual_seed(self.seed * 1_000_003 + index)
            self.examples += batch_size(batch)
            yield to_device(batch, self.device)
        self.examples = int(sum_across([torch.tensor(float(self.examples))])[0])

    def forward(self, batch: dict):
        ctx = torch.autocast(self.device.type, self.autocast) if self.autocast else nullcontext()
        with ctx:
            return self.model(**batch)


METHODS: dict[str, Callable[[ScoringRun], tuple[list[torch.Tensor], list[torch.Tensor] | None]]] = {}


def method(name: str):
    """Register a scoring method under `name` (a function ScoringRun -> (scores, variances or None))."""
    def register(fn):
        METHODS[name] = fn
        return fn

    return register


def batch_size(batch: dict) -> int:
    """Number of examples in a batch (the leading dimension of its first tensor)."""
    return next(v.shape[0] for v in batch.values() if torch.is_tensor(v))


def pooled(outputs, batch: dict) -> torch.Tensor:
    """Mean of the last hidden state over the attended tokens, [batch, hidden] in float32."""
    hidden = outputs.last_hidden_state if getattr(outputs, "last_hidden_state", None) is not None \
        else outputs.hidden_states[-1]
    hidden = hidden.float()
    mask = batch.get("attention_mask")
    if mask is None or mask.shape != hidden.shape[:2]:
        return hidden.mean(1)
    mask = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)


class Objective:
    """The per-example loss that importance is measured against.

    With labels in the batch: the model's task loss per example (classification, regression, causal or
    seq2seq LM). Without labels: the divergence of the gated model's outputs from the ungated model's (KL on
    logits, 1 - cosine of mean-pooled hidden states for encoders without a head). That divergence has zero
    gradient at gates = 1, so the gradient methods use sampled surrogates whose per-example squared
    gradients equal its curvature in expectation: labels drawn from the model's own softmax (the Fisher of
    the KL), or a random Gaussian projection of the normalised embedding (the Gauss-Newton diagonal of
    1 - cosine). `reference` and `divergence` give the exact divergence, used by ablation.
    A custom `loss(outputs, batch) -> scalar` replaces all of this; it is then not split per example.
    """

    def __init__(self, model: nn.Module, loss: Loss | None = None) -> None:
        self.model, self.custom = model, loss
        name = type(model).__name__
        self.shift = name.endswith("ForCausalLM") or "LMHead" in name

    def has_labels(self, batch: dict) -> bool:
        return self.custom is None and "labels" in batch

    def per_example(self, outputs, batch: dict, generator: torch.Generator) -> torch.Tensor:
        """Per-example losses [batch] (a custom loss gives a single value)."""
        if self.custom is not None:
            return self.custom(outputs, batch).reshape(1)
        logits = getattr(outputs, "logits", None)
        if "labels" in batch:
            return self._task_loss(logits, batch["labels"], batch)
        if logits is not None:
            with torch.no_grad():
                probs = torch.softmax(logits.detach().float(), -1)
                sampled = torch.multinomial(probs.reshape(-1, probs.shape[-1]).cpu(), 1, generator=generator)
            sampled = sampled.reshape(probs.shape[:-1]).to(logits.device)
            return self._token_mean(nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), sampled.reshape(-1), reduction="none"
            ).reshape(sampled.shape), batch)
        unit = nn.functional.normalize(pooled(outputs, batch), dim=-1)
        z = torch.randn(unit.shape, generator=generator).to(unit.device)
        return (unit * z).sum(-1)

    def _task_loss(self, logits: torch.Tensor, labels: torch.Tensor, batch: dict) -> torch.Tensor:
        logits = logits.float()
        if logits.dim() == 2 and logits.shape[-1] == 1 and labels.is_floating_point():
            return (logits.squeeze(-1) - labels.float()) ** 2
        if logits.dim() == 2 and labels.dim() == 2:  # multi-label
            return nn.functional.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none").mean(-1)
        if logits.dim() == 2:
            return nn.functional.cross_entropy(logits, labels, reduction="none")
        if self.shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        tokens = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             reduction="none", ignore_index=-100).reshape(labels.shape)
        valid = (labels != -100).float()
        return (tokens * valid).sum(-1) / valid.sum(-1).clamp(min=1)

    def _token_mean(self, tokens: torch.Tensor, batch: dict) -> torch.Tensor:
        if tokens.dim() == 1:
            return tokens
        mask = batch.get("attention_mask")
        if mask is None or mask.shape != tokens.shape:
            return tokens.mean(-1)
        mask = mask.float()
        return (tokens * mask).sum(-1) / mask.sum(-1).clamp(min=1)

    def reference(self, outputs, batch: dict) -> torch.Tensor:
        """What the ungated model produced: log-probabilities, or the normalised pooled embedding."""
        logits = getattr(outputs, "logits", None)
        if logits is not None:
            return torch.log_softmax(logits.detach().float(), -1)
        return nn.functional.normalize(pooled(outputs, batch).detach(), dim=-1)

    def divergence(self, outputs, batch: dict, reference: torch.Tensor) -> torch.Tensor:
        """Per-example KL(reference || gated) on logits, or 1 - cosine on pooled embeddings."""
        logits = getattr(outputs, "logits", None)
        if logits is not None:
            logq = torch.log_softmax(logits.float(), -1)
            return self._token_mean((reference.exp() * (reference - logq)).sum(-1), batch)
        return 1 - (nn.functional.normalize(pooled(outputs, batch), dim=-1) * reference).sum(-1)

    def value(self, outputs, batch: dict, reference: torch.Tensor | None) -> torch.Tensor:
        """The exact per-example objective: task loss with labels, else the divergence from `reference`."""
        if self.custom is not None:
            return self.custom(outputs, batch).reshape(1)
        if "labels" in batch:
            return self._task_loss(outputs.logits, batch["labels"], batch)
        return self.divergence(outputs, batch, reference)


@contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    """Turn off parameter gradients (autograd then computes only what the gates need), restore on exit."""
    flags = [p.requires_grad for p in model.parameters()]
    was_training = model.training
    model.requires_grad_(False).eval()
    try:
        yield
    finally:
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)
        model.train(was_training)


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
                sums[2][i] += (g ** 2).sum(0)
                blocks[i] += g.T @ g
            count += n if per_example else 1
    n = len(run.layers)
    *summed, total = sum_across([*sums[0], *sums[1], *sums[2], *blocks, torch.tensor(float(count))])
    run.meta["fisher_blocks"] = {l.name: b.tolist() for l, b in zip(run.layers, summed[3 * n:])}
    return summed[:n], summed[n:2 * n], summed[2 * n:3 * n], int(total)


def _variance(total: torch.Tensor, total_sq: torch.Tensor, n: int) -> torch.Tensor:
    mean = total / max(n, 1)
    return (total_sq / max(n, 1) - mean ** 2).clamp(min=0) * n / max(n - 1, 1)


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


@method("activation")
def activation_importance(run: ScoringRun):
    """Mean L2 norm of each head's contribution to the layer output (its slice through the output projection)."""
    totals = [torch.zeros(l.num_heads, dtype=torch.float64) for l in run.layers]
    counts = [0] * len(run.layers)
    handles = []

    def hook_for(i: int, layer: AttentionLayer):
        o_proj = resolve(layer.module, layer.spec.o)

        def hook(module, args):
            x = args[0].detach().float()
            heads = x.reshape(-1, layer.num_heads, layer.head_dim)
            weight = weight_matrix(o_proj).detach().float()
            per_head = weight.reshape(weight.shape[0], layer.num_heads, layer.head_dim)
            contribution = torch.einsum("thd,ohd->tho", heads, per_head).norm(dim=-1)
            totals[i] += contribution.sum(0).double().cpu()
            counts[i] += contribution.shape[0]

        return o_proj.register_forward_pre_hook(hook)

    try:
        handles = [hook_for(i, layer) for i, layer in enumerate(run.layers) if layer.num_heads]
        with torch.no_grad():
            for batch in run.iterate("head activations"):
                run.forward(batch)
    finally:
        for handle in handles:
            handle.remove()
    summed = sum_across([*totals, torch.tensor(counts, dtype=torch.float64)])
    return [t / max(float(c), 1) for t, c in zip(summed[:-1], summed[-1])], None


@method("magnitude")
def magnitude_importance(run: ScoringRun):
    """Data-free: ||W_v of the head's KV group||_F * ||W_o columns of the head||_F (the OV path's scale)."""
    scores = []
    for layer in run.layers:
        spec, module, dim = layer.spec, layer.module, layer.head_dim
        o_in = weight_matrix(resolve(module, spec.o)).detach().float().t()  # [in, out]
        o_norm = o_in.reshape(layer.num_heads, dim, -1).flatten(1).norm(dim=1)
        if spec.fused_qkv:
            w = weight_matrix(resolve(module, spec.fused_qkv)).detach().float().t()  # [in, out]
            start = (layer.num_heads + layer.num_kv_heads) * dim
            v = w[:, start:start + layer.num_kv_heads * dim]
        else:
            v = weight_matrix(resolve(module, spec.v)).detach().float().t()  # [in, out]
        v_norm = v.reshape(v.shape[0], layer.num_kv_heads, dim).permute(1, 0, 2).flatten(1).norm(dim=1)
        group_of = [layer.kv_heads.index(h // layer.group_size) for h in layer.heads]
        scores.append((o_norm * v_norm[group_of]).double().cpu())
    return scores, None


@method("ablation")
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


@method("random")
def random_importance(run: ScoringRun):
    """A seeded random baseline."""
    return [torch.rand(l.num_heads, generator=run.generator, dtype=torch.float64) for l in run.layers], None


def score_heads(model: nn.Module, dataloader: Iterable[dict], method: str = "gradient", loss: Loss | None = None,
                device: str | torch.device | None = None, normalize: bool | None = None, seed: int = 0,
                autocast: torch.dtype | None = None, progress: bool = True) -> HeadScores:
    """Measure the importance of every present head of `model` on the batches of `dataloader`.

    Batches are dicts of tensors as the model takes them (with `labels` where the task has them). `loss=None`
    uses the model's task loss with labels, and without labels the divergence from the ungated model (see
    Objective). Methods: see `METHODS` (gradient, taylor, fisher, activation, magnitude, ablation, random).
    Parameters are frozen while scoring (only gate gradients are computed) and restored after. `normalize`
    (default: on for gradient, as Michel et al.) divides each layer's scores by their L2 norm. `device`
    moves the model there (leave it unset for a model loaded with `device_map`, layers on several devices or
    offloaded); `autocast` (e.g. torch.bfloat16) runs the forward under autocast; gates stay float32 in a
    bf16/fp16 model and scores are accumulated in float64 and returned as float32. Deterministic for a given
    seed. Under `accelerate launch` each process scores its share of the batches and every process gets
    the scores of all of them (see `prune_heads.parallel`).
    """
    if method not in METHODS:
        raise ValueError(f"unknown scoring method {method!r}; choose one of {', '.join(sorted(METHODS))}")
    state = distributed()
    if device is None and state is not None and state.device.type != "cpu":
        device = state.device  # one GPU per process
    if device is not None and hasattr(model, "hf_device_map"):
        raise ValueError("the model was loaded with a device_map, which already placed it; leave device unset")
    if device is not None:
        model.to(device)
    target = torch.device(device) if device is not None else input_device(model)
    layers = find_attention(model)
    generator = torch.Generator().manual_seed(seed)
    run = ScoringRun(model, layers, dataloader, Objective(model, loss), target, autocast, generator, progress, seed)
    torch.manual_seed(seed)
    with frozen(model):
        scores, variances = METHODS[method](run)
    if normalize if normalize is not None else method == "gradient":
        norms = [s.norm() for s in scores]
        scores = [s / n if n > 0 else s for s, n in zip(scores, norms)]
        variances = None if variances is None else [v / n ** 2 if n > 0 else v for v, n in zip(variances, norms)]
    names = [l.name for l in layers]
    return HeadScores(
        method=method, num_examples=run.examples,
        scores={n: s.float() for n, s in zip(names, scores)},
        heads={l.name: l.heads for l in layers},
        group_sizes={l.name: l.group_size for l in layers},
        original_heads={l.name: l.original_num_heads for l in layers},
        variance=None if variances is None else {n: v.float() for n, v in zip(names, variances)},
        meta={"normalized": bool(normalize if normalize is not None else method == "gradient"), "seed": seed,
              **run.meta},
    )
