"""Pruning masks: magnitude (``l1``) and learned scores (``topk``) for every pruning granularity.

A mask keeps exactly ``ceil(dense_ratio * n)`` of ``n`` entries (weights, rows, heads or channels):
the largest scores.  ``TopKBinarizer`` passes the gradient of the mask straight to the scores, so
``topk`` scores learn which entries matter (Sanh et al., movement pruning; DeepSpeed's topk).
"""

from __future__ import annotations

import math

import torch


def kept_count(n: int, dense_ratio: float) -> int:
    """How many of ``n`` entries a mask with ``dense_ratio`` keeps (at least one)."""
    return max(1, min(n, math.ceil(dense_ratio * n)))


def topk_mask(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """1 for the ``kept_count`` largest scores, 0 elsewhere (same shape as ``scores``)."""
    flat = scores.detach().reshape(-1)
    keep = torch.topk(flat, kept_count(flat.numel(), dense_ratio), sorted=False).indices
    mask = torch.zeros_like(flat)
    mask[keep] = 1.0
    return mask.reshape(scores.shape)


class TopKBinarizer(torch.autograd.Function):
    """Forward: ``topk_mask(scores)``; backward: the gradient goes to the scores unchanged (STE)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
        return topk_mask(scores, dense_ratio)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, None


# Importance of each prunable unit, used for the l1 masks and to initialise the topk scores.
def weight_importance(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().abs()


def row_importance(weight: torch.Tensor) -> torch.Tensor:
    """L1 norm of each output row of a Linear weight, shape ``(out, 1)``."""
    return weight.detach().abs().sum(dim=1, keepdim=True)


def head_importance(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """L1 norm of each head's block of input columns of an output projection, shape ``(num_heads,)``."""
    out_features, in_features = weight.shape
    return weight.detach().abs().reshape(out_features, num_heads, in_features // num_heads).sum(dim=(0, 2))


def channel_importance(weight: torch.Tensor) -> torch.Tensor:
    """L1 norm of each output channel of a Conv2d weight, shape ``(out, 1, 1, 1)``."""
    return weight.detach().abs().sum(dim=(1, 2, 3), keepdim=True)
