"""Cross entropy over vocabulary-parallel logits (Megatron's ``vocab_parallel_cross_entropy``).

Each tensor-parallel rank holds the logits of its vocabulary rows ``[..., V/world]`` (a
`ColumnParallelLinear` head with ``gather_output=False``, or ``F.linear`` with a
`VocabParallelEmbedding`'s weight). The loss per token is computed without any rank holding the
full ``[..., V]`` logits: three all-reduces of ``[...]``-shaped tensors (the max, the target's logit,
the sum of exponentials). Computed in fp32 after subtracting the global max (no overflow for large
logits); the loss is fp32, the gradient has the logits' dtype.

Backward: every tensor-parallel rank back-propagates the same loss (the result is replicated), so
each rank's gradient for its logits, ``softmax - onehot(target)``, needs no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

import ds_comm

from ._mappings import _rank, _world


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if _world(group) > 1:
        ds_comm.all_reduce(tensor, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, group):
        logits = vocab_parallel_logits.float()
        partition_vocab = logits.size(-1)
        vocab = partition_vocab * _world(group)
        vocab_start = _rank(group) * partition_vocab

        logits_max = logits.amax(dim=-1)
        _all_reduce(logits_max, dist.ReduceOp.MAX, group)
        shifted = logits - logits_max.unsqueeze(-1)

        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= partition_vocab)
        local_target = local_target.masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        if label_smoothing > 0:  # also the sum of the shifted logits (for the mean log-probability): one all-reduce
            sums = torch.stack([predicted, shifted.sum(dim=-1)])
            _all_reduce(sums, dist.ReduceOp.SUM, group)
            predicted, sum_shifted = sums[0], sums[1]
        else:
            _all_reduce(predicted, dist.ReduceOp.SUM, group)

        exp = shifted.exp_()  # ``shifted`` is ours (a new tensor): reuse its memory
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)

        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - predicted
        smoothing = 0.0
        if label_smoothing > 0:  # Megatron's: the other ids share alpha equally, i.e. all ids alpha*V/(V-1)
            smoothing = label_smoothing * vocab / (vocab - 1)
            mean_log_probs = sum_shifted / vocab - log_sum_exp
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.logits_dtype, ctx.smoothing, ctx.vocab = vocab_parallel_logits.dtype, smoothing, vocab
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        softmax, local_target, outside = ctx.saved_tensors
        grad_output = grad_output.to(softmax.dtype)
        grad = softmax * grad_output.unsqueeze(-1)  # a new tensor: the saved softmax stays (retain_graph)
        on_target = (-(1.0 - ctx.smoothing) * grad_output).masked_fill(outside, 0.0)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), on_target.unsqueeze(-1))
        if ctx.smoothing:
            grad.sub_((ctx.smoothing / ctx.vocab) * grad_output.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, group=None) -> torch.Tensor:
    """The cross-entropy loss per token (no reduction, shape ``target.shape``, fp32) of logits split
    along the vocabulary across ``group`` (the tensor-parallel group; None: the default group), rank
    ``r`` holding ids ``[r*n, (r+1)*n)``. ``target`` holds global ids in ``[0, n*world)``; every rank
    passes the same ``target`` and gets the same loss. ``label_smoothing`` (``0 <= alpha < 1``) is
    Megatron's: the target gets ``1 - alpha``, every other id ``alpha / (V - 1)`` (torch's
    ``F.cross_entropy(label_smoothing=alpha * V / (V - 1))``)."""
    if not isinstance(vocab_parallel_logits, torch.Tensor) or not vocab_parallel_logits.is_floating_point():
        raise ValueError("vocab_parallel_cross_entropy: vocab_parallel_logits must be a floating-point tensor, got "
                         f"{getattr(vocab_parallel_logits, 'dtype', type(vocab_parallel_logits).__name__)}")
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int32, torch.int64):
        raise ValueError("vocab_parallel_cross_entropy: target must be an int32/int64 tensor of token ids, got "
                         f"{getattr(target, 'dtype', type(target).__name__)}")
    if vocab_parallel_logits.dim() < 1 or tuple(vocab_parallel_logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(f"vocab_parallel_cross_entropy: target's shape {tuple(target.shape)} must be the logits' "
                         f"shape without the vocabulary dimension, logits {tuple(vocab_parallel_logits.shape)}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing must be in [0, 1), got {label_smoothing!r}")
    vocab = vocab_parallel_logits.size(-1) * _world(group)
    if label_smoothing > 0 and vocab < 2:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing needs a vocabulary of 2 or more ids, got {vocab}")
    if target.numel() and bool(((target < 0) | (target >= vocab)).any()):
        bad = target[(target < 0) | (target >= vocab)][0].item()
        raise ValueError(f"vocab_parallel_cross_entropy: target id {bad} is outside the vocabulary [0, {vocab})")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target.long(), float(label_smoothing), group)
