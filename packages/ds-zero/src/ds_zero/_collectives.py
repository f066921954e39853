"""ZeRO's collectives as plain functions with explicit arguments (FSDP2's ``_fsdp_collectives.py`` shape):
a bucket's reduction, the all-gather of every bucket after a step, and the global gradient norm. The
collectives themselves are ds-comm's; nothing here keeps state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import ds_comm


def start_bucket_reduction(buffer: torch.Tensor, out: torch.Tensor | None, *, group: Any) -> Any:
    """Start summing one bucket's (already scaled) gradients ``buffer`` over ``group``: in place on every
    rank (an all-reduce; ``out`` None), or reduce-scattered into ``out``, this rank's shard. Returns the
    work."""
    if out is None:
        return ds_comm.all_reduce(buffer, group=group, async_op=True)
    return ds_comm.reduce_scatter_bucket(buffer, out, group=group, async_op=True)


def gather_buckets(flat: torch.Tensor, buckets: Sequence[Any], groups: Sequence[Any]) -> None:
    """Every rank's updated shards into every rank's flat parameters: one in-place all-gather per bucket (the
    rank's shard already sits in its place), all in flight at once."""
    works = [ds_comm.all_gather_bucket(flat[b.offset:b.offset + b.padded], group=group, async_op=True)
             for b, group in zip(buckets, groups, strict=True)]
    for work in works:
        work.wait()


def sliced(param: torch.Tensor) -> bool:
    """Whether ``param`` is a tensor-parallel slice (Megatron's ``tensor_model_parallel`` mark, or the older
    ``model_parallel``), as DeepSpeed's is_model_parallel_parameter asks."""
    return bool(getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False))


def grad_norm(params: Sequence[torch.Tensor], *, sharded: bool, layout: Any, rank: int, pieces: Sequence[Any],
              shard_grads: Sequence[torch.Tensor], shard_starts: Sequence[int], replicated: bool, group: Any, model_parallel_group: Any,
              tensor_parallel_rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The global L2 norm as torch.nn.utils.clip_grad_norm_ computes it: the norm of the per-parameter norms
    (in float32 whatever the gradients' dtype; inf or nan when a gradient overflowed). Without ``sharded``
    gradients (stage 0) every reduced gradient is in ``params``' ``.grad``, so this is local and bitwise
    torch's; with them each parameter's sum of squares is summed from this rank's ``pieces`` (in
    ``shard_grads``, per bucket, starting at ``shard_starts``) over ``group`` first. With a ``model_parallel_group`` (pipeline
    stages) the other parts' squares are added, and a copy of a weight another stage owns
    (``ds_pipe_replicated``, a tied weight) is left out, as in DeepSpeed; so is, on tensor-parallel ranks other
    than 0, a parameter without Megatron's ``tensor_model_parallel`` mark (replicated: counted once, as
    DeepSpeed's is_model_parallel_parameter rule). Parameters ``replicated`` over subgroups (`_replicas`) count
    once: with sharded gradients their pieces split them over their group; at stage 0 each bucket's group's
    first rank counts them."""
    first = tensor_parallel_rank == 0
    counted = [not getattr(p, "ds_pipe_replicated", False) and (first or sliced(p)) for p in params]
    if not sharded and replicated:
        norm = _replicated_norm(params, counted, layout, rank, group, device)
    elif not sharded:
        grads = [p.grad for p, c in zip(params, counted, strict=True) if c]
        if dtype == torch.float32:
            norms = torch._foreach_norm(grads)
        else:
            norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
        norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else \
            torch.zeros((), dtype=torch.float32, device=device)
    else:
        squares = torch.zeros(len(params), dtype=torch.float32, device=device)
        for piece in pieces:
            if not counted[piece.index]:
                continue
            shard = shard_grads[piece.bucket]
            part = shard[piece.partition_offset - shard_starts[piece.bucket]:][:piece.numel]
            if part.dtype == torch.float32:
                squares[piece.index] += torch.dot(part, part)
            else:
                squares[piece.index] += torch.linalg.vector_norm(part, dtype=torch.float32).square()
        ds_comm.all_reduce(squares, group=group)
        norm = torch.linalg.vector_norm(squares.sqrt())
    if model_parallel_group is not None and ds_comm.get_world_size(model_parallel_group) > 1:
        total = norm.square()
        ds_comm.all_reduce(total, group=model_parallel_group)
        norm = total.sqrt()
    return norm


def _replicated_norm(params: Sequence[torch.Tensor], counted: list[bool], layout: Any, rank: int, group: Any,
                     device: torch.device) -> torch.Tensor:
    """Stage 0 with replicated parameters: each rank holds its parameters' whole reduced gradients, the same
    on every rank of a parameter's group and different between groups. The first rank of each bucket's group
    adds the squares of its parameters' norms; one all-reduce over ZeRO's group sums them (an inf or NaN
    anywhere reaches every rank)."""
    first = {b: bucket.ranks[0] == rank for b, bucket in enumerate(layout.buckets)}
    grads = [p.grad for p, slot, c in zip(params, layout.slots, counted, strict=True) if c and first[slot.bucket]]
    total = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
        total = torch.stack(norms).square().sum()
    ds_comm.all_reduce(total, group=group)
    return total.sqrt()
