import pytest
import torch
from transformers.modeling_outputs import BaseModelOutput, SequenceClassifierOutput

import prune_heads.scoring.objective as objective_module
from prune_heads.scoring.objective import (
    NEIGHBOUR_TEMPERATURE,
    Objective,
    nearest_neighbours,
    neighbour_changes,
    neighbour_divergence,
)


def unit(x):
    return torch.nn.functional.normalize(torch.as_tensor(x, dtype=torch.float32), dim=-1)


def on_circle(angles):
    return unit(torch.stack([angles.cos(), angles.sin()], -1))


@pytest.mark.parametrize("chunk", [1, 7, 50, 1024])
def test_neighbours_match_the_full_similarity_matrix_in_any_chunking(monkeypatch, chunk):
    g = torch.Generator().manual_seed(0)
    reference, embeddings = unit(torch.randn(50, 8, generator=g)), unit(torch.randn(50, 8, generator=g))
    eye = torch.eye(50, dtype=torch.bool)
    full = (reference.double() @ reference.double().T).masked_fill(eye, -2).argmax(-1)
    log_p, log_q = (
        (x.double() @ x.double().T / NEIGHBOUR_TEMPERATURE).masked_fill(eye, -1e9).log_softmax(-1)
        for x in (reference, embeddings)
    )
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    monkeypatch.setattr(objective_module, "CHUNK", chunk)
    assert torch.equal(nearest_neighbours(reference), full)
    assert neighbour_divergence(reference, embeddings).tolist() == pytest.approx(kl.tolist(), rel=1e-9)


def test_neighbour_changes_and_divergence_mark_the_examples_whose_neighbours_moved():
    angles = torch.tensor([0.0, 0.1, 1.0, 1.15, 2.5])
    reference = on_circle(angles)  # nearest neighbours: 1, 0, 3, 2, 3
    moved = angles.clone()
    moved[2] = 0.18  # now nearest to 1, and 1's nearest becomes 2; 3 keeps 2, 4 keeps 3
    embeddings = on_circle(moved)
    assert neighbour_changes(reference, reference).tolist() == [0.0] * 5
    assert neighbour_changes(reference, embeddings).tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert neighbour_changes(reference[:1], embeddings[:1]).tolist() == [0.0]  # no other example
    assert neighbour_divergence(reference, reference).tolist() == pytest.approx([0.0] * 5, abs=1e-12)
    divergence = neighbour_divergence(reference, embeddings)
    assert int(divergence.argmax()) == 2 and divergence.min() > 0  # the moved one most, the others by a little
    assert neighbour_divergence(reference[:1], embeddings[:1]).tolist() == [0.0]


def test_heldout_adds_the_neighbour_divergence_for_embeddings_only():
    objective = Objective(torch.nn.Identity())
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 3, 8, generator=g)
    noisy = hidden + 0.8 * torch.randn(6, 3, 8, generator=g)
    batches = [{"attention_mask": torch.ones(3, 3, dtype=torch.long)} for _ in range(2)]
    reference_out = [BaseModelOutput(last_hidden_state=h) for h in hidden.split(3)]
    gated_out = [BaseModelOutput(last_hidden_state=h) for h in noisy.split(3)]
    references = [objective.reference(o, b) for o, b in zip(reference_out, batches)]
    values = objective.heldout(zip(gated_out, batches, references))
    ref, emb = unit(hidden.mean(1)), unit(noisy.mean(1))
    ranking = neighbour_divergence(ref, emb)
    assert ranking.min() > 0  # the case tests the ranking term, across the two batches
    assert values.tolist() == pytest.approx((1 - (ref * emb).sum(-1).double() + ranking).tolist(), abs=1e-6)

    logits = [SequenceClassifierOutput(logits=torch.randn(3, 4, generator=g)) for _ in range(2)]
    targets = [objective.reference(SequenceClassifierOutput(logits=torch.randn(3, 4, generator=g)), b) for b in batches]
    plain = torch.cat([objective.divergence(o, b, t).double() for o, b, t in zip(logits, batches, targets)])
    assert torch.equal(objective.heldout(zip(logits, batches, targets)), plain)


def test_the_probe_is_a_deterministic_logistic_regression_and_gives_the_encoders_task_loss():
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(60) % 3
    embeddings = unit(torch.eye(8)[labels] * 3 + 0.3 * torch.randn(60, 8, generator=g))  # three separable classes
    probe = objective_module.fit_probe(embeddings, labels)
    again = objective_module.fit_probe(embeddings, labels)
    assert torch.equal(probe.weight, again.weight) and not probe.weight.requires_grad
    assert bool((probe(embeddings.double()).argmax(-1) == labels).all())
    hidden = torch.randn(4, 5, 8, generator=g)
    batch = {"attention_mask": torch.ones(4, 5, dtype=torch.long), "labels": torch.tensor([0, 1, 2, 0])}
    outputs = BaseModelOutput(last_hidden_state=hidden)
    objective = Objective(torch.nn.Identity(), probe=probe)
    expected = torch.nn.functional.cross_entropy(
        probe(unit(hidden.mean(1)).double()), batch["labels"], reduction="none"
    ).float()
    assert torch.allclose(objective.per_example(outputs, batch, g), expected)
    assert torch.allclose(objective.value(outputs, batch, None), expected)
    assert "labels" not in objective.inputs(batch) and "labels" in Objective(torch.nn.Identity()).inputs(batch)


def test_per_position_tells_a_language_models_references_from_one_output_per_example():
    objective, batch = Objective(torch.nn.Identity()), {"attention_mask": torch.ones(2, 5, dtype=torch.long)}
    small = objective.reference(SequenceClassifierOutput(logits=torch.randn(2, 5, 7)), batch)  # tokens, 7 classes
    large = objective.reference(SequenceClassifierOutput(logits=torch.randn(2, 5, 5000)), batch)  # top-k and rest
    classes = objective.reference(SequenceClassifierOutput(logits=torch.randn(2, 5000)), batch)  # one per example
    embedding = objective.reference(BaseModelOutput(last_hidden_state=torch.randn(2, 5, 8)), batch)
    assert isinstance(large, tuple) and isinstance(classes, tuple)  # both coarsened to the top classes
    assert [Objective.per_position(r) for r in (small, large, classes, embedding)] == [True, True, False, False]
