"""The objective that head importance and recovery are measured against: the task loss with labels, else
the divergence of the (gated or pruned) model's outputs from the unpruned model's."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..runtime.devices import to_device
from ..runtime.memory import release_freed_memory
from ..task_data import without_labels

Loss = Callable[[object, dict], torch.Tensor]
Gather = Callable[[list[torch.Tensor]], list[torch.Tensor]]  # per-batch values joined across processes
Reference = torch.Tensor | tuple[torch.Tensor, ...]  # what `Objective.reference` keeps of an output
TOP_K = 64  # classes kept per token in a reference distribution (the rest share one bin)


def _log_rest(log_top: torch.Tensor) -> torch.Tensor:
    """log(1 - sum(exp(log_top))): the log-probability of every class outside the top ones."""
    return torch.log1p(-torch.logsumexp(log_top, -1).exp().clamp(max=1 - 1e-6))


def pooled(outputs, batch: dict) -> torch.Tensor:
    """Mean of the last hidden state over the attended tokens, [batch, hidden] in float32."""
    hidden = (
        outputs.last_hidden_state
        if getattr(outputs, "last_hidden_state", None) is not None
        else outputs.hidden_states[-1]
    )
    hidden = hidden.float()
    mask = batch.get("attention_mask")
    if mask is None or mask.shape != hidden.shape[:2]:
        return hidden.mean(1)
    mask = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)


def unit_embedding(outputs: Any, batch: dict) -> torch.Tensor:
    """The L2-normalised mean-pooled embedding [batch, hidden] (see `pooled`)."""
    return nn.functional.normalize(pooled(outputs, batch), dim=-1)


NEIGHBOUR_TEMPERATURE = 0.05  # of the softmax over cosine similarities (SimCSE's): close to hard neighbours
CHUNK = 1024  # rows of an examples x examples similarity matrix held at once


def _to_others(embeddings: torch.Tensor) -> Iterator[torch.Tensor]:
    """The similarities of each row to every row, `CHUNK` rows at a time ([chunk, rows]), its own set to -inf."""
    embeddings = embeddings.double()
    for start in range(0, len(embeddings), CHUNK):
        similarity = embeddings[start : start + CHUNK] @ embeddings.T
        rows = torch.arange(similarity.shape[0], device=similarity.device)
        similarity[rows, rows + start] = -float("inf")
        yield similarity


def nearest_neighbours(embeddings: torch.Tensor) -> torch.Tensor:
    """Each row's nearest other row by dot product (cosine for unit rows), [rows] long."""
    found = [similarity.argmax(-1) for similarity in _to_others(embeddings)]
    return torch.cat(found) if found else torch.zeros(0, dtype=torch.long)


def neighbour_changes(reference: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """Per example, 1.0 where its nearest neighbour among the other examples differs between the reference
    embeddings and these (what a retrieval user sees), else 0.0 (always for a lone example); [examples]
    float64."""
    return (nearest_neighbours(reference) != nearest_neighbours(embeddings)).double()


def neighbour_divergence(reference: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """Per example, KL(p || q) of its neighbour distributions over the other examples: softmax of the cosine
    similarities / NEIGHBOUR_TEMPERATURE, p from the reference embeddings, q from these. A smooth form of
    neighbour agreement: 0 when every example keeps its similarities to the others, large when its nearest
    neighbours change. [examples] float64 (zeros for fewer than two examples)."""
    if len(reference) < 2:
        return torch.zeros(len(reference), dtype=torch.float64)
    values = []
    for p, q in zip(_to_others(reference), _to_others(embeddings)):
        log_p = torch.log_softmax(p / NEIGHBOUR_TEMPERATURE, -1)
        log_q = torch.log_softmax(q / NEIGHBOUR_TEMPERATURE, -1)
        values.append(torch.where(p.isfinite(), log_p.exp() * (log_p - log_q), 0.0).sum(-1))
    return torch.cat(values).cpu()


def fit_probe(embeddings: torch.Tensor, labels: torch.Tensor, steps: int = 100) -> nn.Linear:
    """A multinomial logistic regression from embeddings [examples, hidden] to class labels [examples], float64:
    the objective of scikit-learn's default (summed log-loss + ||W||^2 / 2, C = 1, MTEB's classifier), fitted
    with L-BFGS from zeros (deterministic). The task head an encoder without one is judged by."""
    x, y = embeddings.detach().double().cpu(), labels.long().cpu()
    probe = nn.Linear(x.shape[1], int(y.max()) + 1, dtype=torch.float64)
    nn.init.zeros_(probe.weight)
    nn.init.zeros_(probe.bias)
    optimizer = torch.optim.LBFGS(probe.parameters(), max_iter=steps, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        value = nn.functional.cross_entropy(probe(x), y, reduction="sum") + (probe.weight**2).sum() / 2
        value.backward()
        return value

    with torch.enable_grad():
        optimizer.step(loss)
    return probe.requires_grad_(False)


@torch.no_grad()
def encoder_probe(model: nn.Module, batches: Iterable[dict], device: torch.device) -> nn.Linear | None:
    """For a list of batches with class `labels` and a model whose outputs have no logits (an encoder
    without a head), `fit_probe` on its embeddings of them; else None (the labels are then the model's own).
    A transformers model with a head (its `base_model` is another module, or it has output embeddings) is
    known without a forward pass."""
    if not isinstance(batches, list) or not batches or "labels" not in batches[0]:
        return None
    output_embeddings = getattr(model, "get_output_embeddings", lambda: None)()
    if getattr(model, "base_model", model) is not model or output_embeddings is not None:
        return None
    embeddings = []
    for batch in batches:
        inputs = to_device(without_labels(batch), device)
        embedding = Objective.embedding(model(**inputs), inputs)
        if embedding is None:
            return None
        embeddings.append(embedding)
    return fit_probe(torch.cat(embeddings), torch.cat([b["labels"] for b in batches]))


class Objective:
    """The per-example loss that importance is measured against.

    With labels in the batch: the model's task loss per example (classification, regression, causal or
    seq2seq LM; for an encoder without a head, the cross-entropy of `probe`, a logistic regression fitted on
    its unpruned embeddings of the labelled calibration examples). Without labels: the divergence of the
    gated model's outputs from the ungated model's (KL on logits, 1 - cosine of mean-pooled hidden states
    for encoders without a head). That divergence has zero gradient at gates = 1, so the gradient methods
    use sampled surrogates whose per-example squared gradients equal its curvature in expectation: labels
    drawn from the model's own softmax (the Fisher of the KL), or a random Gaussian projection of the
    normalised embedding (the Gauss-Newton diagonal of 1 - cosine). `reference` and `divergence` give the
    exact divergence, used by ablation.
    A custom `loss(outputs, batch) -> scalar` replaces all of this; it is then not split per example.
    """

    def __init__(self, model: nn.Module, loss: Loss | None = None, probe: nn.Linear | None = None) -> None:
        self.model, self.custom, self.probe = model, loss, probe
        name = type(model).__name__
        self.shift = name.endswith("ForCausalLM") or "LMHead" in name

    def has_labels(self, batch: dict) -> bool:
        return self.custom is None and "labels" in batch

    def inputs(self, batch: dict) -> dict:
        """What the model is called with: the batch, less the labels that only the probe takes."""
        return without_labels(batch) if self.probe is not None else batch

    def per_example(self, outputs, batch: dict, generator: torch.Generator) -> torch.Tensor:
        """Per-example losses [batch] (a custom loss gives a single value)."""
        if self.custom is not None:
            return self.custom(outputs, batch).reshape(1)
        logits = getattr(outputs, "logits", None)
        if "labels" in batch:
            return self._task_loss(outputs, batch)
        if logits is not None:
            with torch.no_grad():
                probs = torch.softmax(logits.detach().float(), -1)
                sampled = torch.multinomial(probs.reshape(-1, probs.shape[-1]).cpu(), 1, generator=generator)
            sampled = sampled.reshape(probs.shape[:-1]).to(logits.device)
            return self._token_mean(
                nn.functional.cross_entropy(
                    logits.float().reshape(-1, logits.shape[-1]), sampled.reshape(-1), reduction="none"
                ).reshape(sampled.shape),
                batch,
            )
        unit = unit_embedding(outputs, batch)
        z = torch.randn(unit.shape, generator=generator).to(unit.device)
        return (unit * z).sum(-1)

    def _task_loss(self, outputs, batch: dict) -> torch.Tensor:
        labels = batch["labels"]
        if self.probe is not None:
            embedding = unit_embedding(outputs, batch)
            logits = self.probe.to(embedding.device)(embedding.double())
            return nn.functional.cross_entropy(logits, labels, reduction="none").to(embedding.dtype)
        logits = outputs.logits.float()
        if logits.dim() == 2 and logits.shape[-1] == 1 and labels.is_floating_point():
            return (logits.squeeze(-1) - labels.float()) ** 2
        if logits.dim() == 2 and labels.dim() == 2:  # multi-label
            return nn.functional.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none").mean(-1)
        if logits.dim() == 2:
            return nn.functional.cross_entropy(logits, labels, reduction="none")
        if self.shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        tokens = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none", ignore_index=-100
        ).reshape(labels.shape)
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

    @staticmethod
    def embedding(outputs, batch: dict) -> torch.Tensor | None:
        """The L2-normalised pooled embedding [batch, hidden] of a model without logits, else None."""
        if getattr(outputs, "logits", None) is not None:
            return None
        return unit_embedding(outputs, batch)

    def reference(self, outputs, batch: dict) -> Reference:
        """What the ungated model produced, as `divergence` takes it: log-probabilities (over at most
        TOP_K classes: beyond that the top TOP_K and one bin for the rest, so per-token targets of a large
        vocabulary stay small), or the normalised pooled embedding."""
        embedding = self.embedding(outputs, batch)
        if embedding is not None:
            return embedding.detach()
        logp = torch.log_softmax(outputs.logits.detach().float(), -1)
        if logp.shape[-1] <= TOP_K:
            return logp
        top, index = logp.topk(TOP_K, dim=-1)
        return top, index, _log_rest(top)

    @staticmethod
    def per_position(reference) -> bool:
        """Whether a `reference` holds an output per position (a language model's tokens: [batch, positions,
        classes]) rather than one per example (a class distribution or an embedding)."""
        first = reference[0] if isinstance(reference, tuple) else reference
        return first.dim() > 2

    def divergence(self, outputs, batch: dict, reference) -> torch.Tensor:
        """Per-example KL(reference || gated) on logits (on the reference's top TOP_K classes and one bin for
        the rest when the vocabulary is larger: the KL of the coarsened distributions), or 1 - cosine on
        pooled embeddings."""
        embedding = self.embedding(outputs, batch)
        if embedding is not None:
            return 1 - (embedding * reference).sum(-1)
        logq = torch.log_softmax(outputs.logits.float(), -1)
        if torch.is_tensor(reference):
            kl = (reference.exp() * (reference - logq)).sum(-1)
        else:
            top, index, rest = reference
            q_top = logq.gather(-1, index)
            kl = (top.exp() * (top - q_top)).sum(-1) + rest.exp() * (rest - _log_rest(q_top))
        return self._token_mean(kl, batch)

    def heldout(self, runs: Iterable[tuple[Any, dict, Any]], gathered: Gather = list) -> torch.Tensor:
        """Per-example held-out values [examples] float64, which recovery's decisions minimise, from
        (outputs, batch, reference) per batch (a generator keeps one batch's outputs at a time; data-parallel,
        this process's rows of each, joined with every process's by `gathered`, `Shards.gathered`): the
        divergence from the reference; for embeddings plus the divergence of its neighbour distribution among all
        these examples (`neighbour_divergence`), so ranking, what a retrieval user sees, is judged beside cosine."""
        parts, embeddings, references = [], [], []
        for outputs, batch, reference in runs:
            parts.append(self.divergence(outputs, batch, reference).double().cpu())
            embedding = self.embedding(outputs, batch)
            if embedding is not None:
                embeddings.append(embedding.detach().cpu())
                references.append(reference.cpu())
            release_freed_memory()
        values = torch.cat(gathered(parts))
        embeddings, references = gathered(embeddings), gathered(references)  # every process calls each gather
        if embeddings:
            values += neighbour_divergence(torch.cat(references), torch.cat(embeddings))
        return values

    def value(self, outputs, batch: dict, reference: Reference | None) -> torch.Tensor:
        """The exact per-example objective: task loss with labels, else the divergence from `reference`."""
        if self.custom is not None:
            return self.custom(outputs, batch).reshape(1)
        if "labels" in batch:
            return self._task_loss(outputs, batch)
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
