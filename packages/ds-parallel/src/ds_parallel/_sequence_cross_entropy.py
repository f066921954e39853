"""DeepSpeed's ``deepspeed.sequence.cross_entropy.vocab_sequence_parallel_cross_entropy``: the cross-entropy
loss of logits whose sequence is split across a sequence-parallel group (Ulysses) and, optionally, whose
vocabulary is split across a tensor-parallel group. Megatron-DeepSpeed calls it as
``vocab_sequence_parallel_cross_entropy(logits, labels, sp_group)`` with the sequence leading.

Layout: ``vocab_parallel_logits`` is ``[seq/P, ..., V/T]`` (DeepSpeed's ``[seq/P, batch, vocab]``), ``target``
``[seq/P, ...]``: sequence-parallel rank ``r`` holds rows ``[r*seq/P, (r+1)*seq/P)`` of the leading dimension,
tensor-parallel rank ``t`` the vocabulary ids ``[vocab_start_index, vocab_end_index)`` (default: equal shards,
``t*V/T`` on).

* Per token: ``log(sum(exp(logits))) - logits[target]`` in fp32 (after subtracting the max over the whole
  vocabulary), 0 where ``target == ignore_index``. Over the tensor-parallel group: one all-reduce (max), one
  (target logit + sum of exponentials), no rank holds the full vocabulary.
* ``reduction="none"``, ``gather_sequence_loss=True`` (the default): the per-token losses of every
  sequence-parallel rank are all-gathered along the leading dimension: ``[seq, ...]`` on every rank. Backward
  keeps this rank's rows of the incoming gradient (DeepSpeed's "legacy local-slice gradient": no reduction,
  every rank back-propagates the same replicated loss), so each rank's logits get exactly their part of the
  full sequence's gradient. Every rank must hold the same number of sequence rows.
* ``gather_sequence_loss=False``: ``"none"`` returns the local ``[seq/P, ...]`` losses; ``"sum"`` the sum over the
  whole sequence-parallel group; ``"mean"`` that sum over the group's count of non-ignored tokens. Both have
  the global value but send gradient to the local tokens only (as DeepSpeed).

Collectives go through ds_comm (the comms logger sees them). ``tp_group=None`` / ``sp_group=None`` mean no
such parallelism (DeepSpeed's ``pg_utils`` convention), never the default group.
"""

from __future__ import annotations

import logging

import torch
from torch.autograd.function import once_differentiable

import ds_comm

logger = logging.getLogger(__name__)

_REDUCTIONS = ("none", "sum", "mean")
_BACKENDS = ("torch", "liger")
_warned_liger = False
_META_DIMS = 8  # leading dims of the local loss shape compared across the sequence-parallel group


def _world(group) -> int:
    return 1 if group is None else ds_comm.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else ds_comm.get_rank(group)


class _VocabShardCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of logits sharded on the vocabulary over ``tp_group`` (None: unsharded)."""

    @staticmethod
    def forward(ctx, logits, target, tp_group, vocab_start, ignore_index):
        logits32 = logits.float()
        local_vocab = logits32.size(-1)
        valid = target != ignore_index
        local_target = target - vocab_start
        here = valid & (local_target >= 0) & (local_target < local_vocab)
        local_target = local_target.masked_fill(~here, 0)

        global_max = logits32.amax(dim=-1)
        if _world(tp_group) > 1:
            ds_comm.all_reduce(global_max, op=ds_comm.ReduceOp.MAX, group=tp_group)
        shifted = logits32 - global_max.unsqueeze(-1)  # a new tensor: exponentiated in place below
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
        exp = shifted.exp_()
        sums = torch.stack([picked, exp.sum(dim=-1)])
        if _world(tp_group) > 1:
            ds_comm.all_reduce(sums, group=tp_group)
        picked, sum_exp = sums[0], sums[1]

        loss = (sum_exp.log() - picked).masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, here, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        softmax, local_target, here, valid = ctx.saved_tensors
        grad_output = grad_output.to(softmax.dtype).masked_fill(~valid, 0.0)
        grad = softmax * grad_output.unsqueeze(-1)  # new tensor: the saved softmax survives retain_graph
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (-grad_output).masked_fill(~here, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


class _GatherSequenceLoss(torch.autograd.Function):
    """Forward: all-gather along dim 0 over the sequence-parallel group; backward: this rank's rows."""

    @staticmethod
    def forward(ctx, local_loss, sp_group):
        world, rank = _world(sp_group), _rank(sp_group)
        local_loss = local_loss.contiguous()
        rows = local_loss.size(0)
        out = torch.empty((world * rows, *local_loss.shape[1:]), dtype=local_loss.dtype, device=local_loss.device)
        ds_comm.all_gather_into_tensor(out, local_loss, group=sp_group)
        ctx.start, ctx.rows = rank * rows, rows
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        return grad_output.narrow(0, ctx.start, ctx.rows).contiguous(), None


def _global_sum(local: torch.Tensor, sp_group) -> torch.Tensor:
    """The sum over the sequence-parallel group; gradient flows to ``local`` only."""
    if _world(sp_group) == 1:
        return local
    total = local.detach().clone()
    ds_comm.all_reduce(total, group=sp_group)
    return local + (total - local.detach())


def _check_sequence_shapes(loss: torch.Tensor, sp_group) -> None:
    """Every sequence-parallel rank must hold a loss of the same shape for the gather (one small all-gather)."""
    shape = list(loss.shape)
    meta = [loss.dim(), *(shape[:_META_DIMS] + [0] * (_META_DIMS - len(shape[:_META_DIMS]))), loss.numel()]
    local = torch.tensor(meta, dtype=torch.long, device=loss.device)
    world = _world(sp_group)
    gathered = torch.empty(world * local.numel(), dtype=torch.long, device=loss.device)
    ds_comm.all_gather_into_tensor(gathered, local, group=sp_group)
    rows = gathered.view(world, -1).tolist()
    if any(row != rows[0] for row in rows):
        shapes = [tuple(row[1:1 + min(row[0], _META_DIMS)]) for row in rows]
        raise ValueError("vocab_sequence_parallel_cross_entropy: every rank of the sequence-parallel group "
                         f"(sp_group, {world} ranks) must hold target of the same shape to gather the loss, "
                         f"got {shapes} by sequence-parallel rank")


def _vocab_bounds(local_vocab: int, vocab_start_index, vocab_end_index, tp_group, device) -> tuple[int, int]:
    """This rank's vocabulary start and the global vocabulary size, checked across ``tp_group``."""
    name = "vocab_sequence_parallel_cross_entropy"
    world = _world(tp_group)
    if world == 1:
        start = 0 if vocab_start_index is None else int(vocab_start_index)
        end = local_vocab if vocab_end_index is None else int(vocab_end_index)
        if local_vocab == 0:
            raise ValueError(f"{name}: vocab_parallel_logits must hold at least one vocabulary entry, got shape "
                             f"(..., 0)")
        if (start, end) != (0, local_vocab):
            raise ValueError(f"{name}: without tensor parallelism (tp_group None or of one rank) the vocabulary "
                             f"bounds must be [0, {local_vocab}) (the logits' last dimension), got "
                             f"[{vocab_start_index}, {vocab_end_index})")
        return 0, local_vocab
    explicit = vocab_start_index is not None
    meta = [local_vocab, int(explicit), int(vocab_start_index or 0), int(vocab_end_index or 0)]
    local = torch.tensor(meta, dtype=torch.long, device=device)
    gathered = torch.empty(world * len(meta), dtype=torch.long, device=device)
    ds_comm.all_gather_into_tensor(gathered, local, group=tp_group)
    rows = gathered.view(world, -1).tolist()
    sizes = [row[0] for row in rows]
    if min(sizes) <= 0:
        raise ValueError(f"{name}: every tensor-parallel rank (tp_group, {world} ranks) needs a non-empty "
                         f"vocabulary shard, got local vocabulary sizes {sizes}")
    if len({row[1] for row in rows}) != 1:
        raise ValueError(f"{name}: vocab_start_index/vocab_end_index must be given on every tensor-parallel rank "
                         f"(tp_group, {world} ranks) or on none")
    if not explicit:
        if len(set(sizes)) != 1:
            raise ValueError(f"{name}: uneven vocabulary shards {sizes} over the tensor-parallel group (tp_group) "
                             "need explicit vocab_start_index and vocab_end_index")
        return _rank(tp_group) * local_vocab, local_vocab * world
    expected = 0
    for tp_rank, (size, _, start, end) in enumerate(rows):
        if end - start != size or start != expected:
            bounds = [(row[2], row[3]) for row in rows]
            raise ValueError(f"{name}: the vocabulary bounds {bounds} of the tensor-parallel ranks (tp_group) must "
                             f"partition [0, V) contiguously in rank order, each as wide as the rank's logits "
                             f"(local sizes {sizes}); tensor-parallel rank {tp_rank} breaks it")
        expected = end
    return int(vocab_start_index), expected


def vocab_sequence_parallel_cross_entropy(vocab_parallel_logits, target, sp_group, tp_group=None,
                                          vocab_start_index=None, vocab_end_index=None, ignore_index=-100,
                                          reduction="none", gather_sequence_loss=True, backend="torch"):
    """Cross entropy of ``[seq/P, ..., V/T]`` logits, the sequence split over ``sp_group`` and the vocabulary
    over ``tp_group`` (None: not split); ``target`` ``[seq/P, ...]`` holds global token ids (``ignore_index``:
    no loss, no gradient). Default: the fp32 per-token losses of the whole sequence, ``[seq, ...]``, on every
    sequence-parallel rank; backward sends each rank the gradient of its own rows. ``gather_sequence_loss=False``
    with ``reduction`` ``"none"`` (local losses), ``"sum"`` or ``"mean"`` (over the sequence-parallel group's
    tokens). ``backend="liger"`` (Liger's fused kernel) is not built here: as DeepSpeed where the kernel cannot
    run, it logs a warning and uses the PyTorch path (same results)."""
    name = "vocab_sequence_parallel_cross_entropy"
    if backend not in _BACKENDS:
        raise ValueError(f"{name}: backend must be one of {_BACKENDS}, got {backend!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if gather_sequence_loss and reduction != "none":
        raise ValueError(f"{name}: gather_sequence_loss=True needs reduction='none', got reduction={reduction!r}")
    if gather_sequence_loss and sp_group is None:
        raise ValueError(f"{name}: gather_sequence_loss=True needs a sequence-parallel group, got sp_group=None")
    if not isinstance(vocab_parallel_logits, torch.Tensor) or not vocab_parallel_logits.is_floating_point():
        raise ValueError(f"{name}: vocab_parallel_logits must be a floating-point tensor, got "
                         f"{getattr(vocab_parallel_logits, 'dtype', type(vocab_parallel_logits).__name__)}")
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex() \
            or target.dtype == torch.bool:
        raise ValueError(f"{name}: target must be an integer tensor of token ids, got "
                         f"{getattr(target, 'dtype', type(target).__name__)}")
    if vocab_parallel_logits.dim() < 2 or tuple(vocab_parallel_logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(f"{name}: target's shape {tuple(target.shape)} must be the logits' shape without the "
                         f"vocabulary dimension ([seq/P, ..., V/T] and [seq/P, ...]), logits "
                         f"{tuple(vocab_parallel_logits.shape)}")
    if (vocab_start_index is None) != (vocab_end_index is None):
        raise ValueError(f"{name}: vocab_start_index and vocab_end_index go together, got {vocab_start_index!r} "
                         f"and {vocab_end_index!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"{name}: ignore_index must be an int, got {ignore_index!r}")
    if backend == "liger":
        global _warned_liger
        if not _warned_liger:
            logger.warning("%s: backend='liger' (Liger's fused kernel) is not built; using the PyTorch path", name)
            _warned_liger = True

    vocab_start, vocab = _vocab_bounds(vocab_parallel_logits.size(-1), vocab_start_index, vocab_end_index,
                                       tp_group, vocab_parallel_logits.device)
    target = target.long()
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        raise ValueError(f"{name}: target id {target[bad][0].item()} is outside the vocabulary [0, {vocab}) "
                         f"(ignore_index {ignore_index})")

    loss = _VocabShardCrossEntropy.apply(vocab_parallel_logits, target, tp_group, vocab_start, ignore_index)
    if reduction == "none":
        if not gather_sequence_loss or _world(sp_group) == 1:
            return loss
        _check_sequence_shapes(loss, sp_group)
        return _GatherSequenceLoss.apply(loss, sp_group)
    total = _global_sum(loss.sum(), sp_group)
    if reduction == "sum":
        return total
    tokens = (target != ignore_index).sum().to(loss.dtype)
    if _world(sp_group) > 1:
        ds_comm.all_reduce(tokens, group=sp_group)
    return total / tokens.clamp_min(1)
