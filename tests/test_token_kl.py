from types import SimpleNamespace

import torch

from prune_heads.recovery import token_kl as module
from prune_heads.recovery.token_kl import token_kl
from prune_heads.scoring.objective import Objective


def autograd_kl(logits: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The divergence the flow judges by, through autograd: what `token_kl` must equal."""
    objective = Objective(torch.nn.Linear(1, 1))  # its divergence reads only the outputs, batch and reference
    batch = {} if mask is None else {"attention_mask": mask}
    logp = torch.log_softmax(reference.float(), -1)
    return objective.divergence(SimpleNamespace(logits=logits), batch, logp).mean()


def test_the_loss_and_its_gradient_equal_autograds_in_blocks_of_positions(monkeypatch):
    monkeypatch.setattr(module, "BLOCK", 5)  # blocks that cut across examples, the last one short
    g = torch.Generator().manual_seed(0)
    reference = torch.randn(3, 7, 11, generator=g) * 3
    start = torch.randn(3, 7, 11, generator=g) * 3
    mask = torch.ones(3, 7)
    mask[1, 4:] = 0  # padding on the right
    mask[2] = 0  # an example with nothing attended counts as 0
    for m in (mask, None):
        ours, theirs = start.clone().requires_grad_(), start.clone().requires_grad_()
        fused, plain = token_kl(ours, reference, m), autograd_kl(theirs, reference, m)
        (2 * fused).backward()
        (2 * plain).backward()
        assert torch.allclose(fused, plain, atol=1e-6) and fused.item() > 0
        assert torch.allclose(ours.grad, theirs.grad, atol=1e-6)
    assert token_kl(reference, reference, mask) < 1e-6


def test_the_gradient_takes_the_logits_dtype_and_the_reference_none():
    reference = torch.randn(2, 3, 5)
    logits = torch.randn(2, 3, 5, dtype=torch.bfloat16, requires_grad=True)
    token_kl(logits, reference.requires_grad_(), None).backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16 and reference.grad is None
