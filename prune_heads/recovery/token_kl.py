"""The heal's loss for a language model: forward KL from the teacher's next-token distribution to the student's
at every position over the whole vocabulary, taken a block of positions at a time.

Autograd would keep a float32 copy of both distributions and their difference for the whole batch (a batch of
7 x 256 tokens over Gemma 3's 262,144 tokens: about 1.9 GB each); here each block's gradient with respect to the
student's logits (its softmax less the teacher's, weighted) is made during the forward pass and kept in the
logits' dtype, so the batch holds one tensor the size of its logits and a block's float32 work at a time.
"""

from __future__ import annotations

from typing import Any

import torch

BLOCK = 256  # positions a block: its float32 work stays far below the logits themselves


class _TokenKL(torch.autograd.Function):
    """sum over positions of weight x KL(softmax(reference) || softmax(logits)); the gradient made forward."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, reference: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        flat, taught = logits.reshape(-1, logits.shape[-1]), reference.reshape(-1, reference.shape[-1])
        weight = weights.reshape(-1).float()
        gradient = torch.empty_like(flat)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, len(flat), BLOCK):
            block = slice(start, start + BLOCK)
            logq = torch.log_softmax(flat[block].float(), -1)
            logp = torch.log_softmax(taught[block].float(), -1)
            p = logp.exp()
            total += ((p * (logp - logq)).sum(-1) * weight[block]).sum()
            gradient[block] = logq.exp_().sub_(p).mul_(weight[block, None])
        ctx.save_for_backward(gradient)
        ctx.shape = logits.shape
        return total

    @staticmethod
    def backward(ctx: Any, upstream: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (gradient,) = ctx.saved_tensors
        return (gradient * upstream.to(gradient.dtype)).reshape(ctx.shape), None, None


def token_kl(logits: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean over examples of each example's mean over its attended positions (all, without `mask`) of
    KL(softmax(`reference`) || softmax(`logits`)), both [examples, positions, vocabulary]: `Objective.divergence`
    on the whole vocabulary, averaged as the heal averages it, differentiable in `logits` only."""
    if mask is None or mask.shape != logits.shape[:2]:
        mask = torch.ones(logits.shape[:2], device=logits.device)
    mask = mask.float()
    weights = mask / mask.sum(-1, keepdim=True).clamp(min=1) / len(mask)
    return _TokenKL.apply(logits, reference.detach(), weights)
