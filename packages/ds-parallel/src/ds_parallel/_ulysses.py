"""Ulysses sequence parallelism: DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention``.

Each rank of the sequence-parallel group holds a slice of the sequence of q, k and v with every
head. An all-to-all turns that into the whole sequence with a slice of the heads, the local
attention (any callable) runs on it, and the reverse all-to-all turns its output back into the
rank's slice of the sequence with every head. Attention is per head, so the result is the
attention of the whole sequence; the all-to-alls carry ``3/P`` (q, k, v) and ``1/P`` (output) of
the activations each way, independent of the number of ranks' sequence slices.

Layouts (DeepSpeed's): with ``batch_dim_idx=0`` q/k/v are ``[batch, seq/P, heads, head_dim]`` and
the local attention sees ``[batch, seq, heads/P, head_dim]``; with ``batch_dim_idx=1`` they are
``[seq/P, batch, heads, head_dim]`` (Megatron's sequence-first layout). Without ``batch_dim_idx``
the all-to-all splits dimension ``scatter_idx`` and concatenates along ``gather_idx``, literally
(DeepSpeed's default ``gather_idx=0`` is the sequence-first layout).

Sequence slice ``r`` of the group's rank ``r`` is the ``r``-th contiguous block of the sequence,
and head block ``r`` (heads ``r*H/P`` to ``(r+1)*H/P``) is what rank ``r`` attends over.
"""

from __future__ import annotations

from typing import Any

import torch

import ds_comm

__all__ = ["DistributedAttention", "SeqAllToAll", "seq_all_to_all"]


def _group_size(group) -> int:
    if not ds_comm.is_initialized():
        raise RuntimeError("Ulysses sequence parallelism needs torch.distributed initialised "
                           "(ds_comm.init_distributed) before the first forward")
    return ds_comm.get_world_size(group)


def _resolve_dims(ndim: int, scatter_idx: int, gather_idx: int, batch_dim_idx: int | None) -> tuple[int, int]:
    """The (split, concatenate) dimensions of one all-to-all.

    With ``batch_dim_idx`` (DeepSpeed 0.19.8's form, 4-D tensors) the sequence dimension is the one
    of dims 0 and 1 that is not the batch, and the heads are the one of ``scatter_idx``/``gather_idx``
    that is 2 or more: ``scatter_idx >= 2`` scatters heads and gathers the sequence, otherwise the
    reverse. Without it the indices are used as given."""
    for name, value in (("scatter_idx", scatter_idx), ("gather_idx", gather_idx)):
        if not isinstance(value, int) or isinstance(value, bool) or not -ndim <= value < ndim:
            raise ValueError(f"{name} must be a dimension of the {ndim}-D input (-{ndim} to {ndim - 1}), got {value!r}")
    scatter, gather = scatter_idx % ndim, gather_idx % ndim
    if batch_dim_idx is None:
        if scatter == gather:
            raise ValueError(f"scatter_idx and gather_idx must be different dimensions, got {scatter_idx} and {gather_idx}")
        return scatter, gather
    if batch_dim_idx not in (0, 1) or isinstance(batch_dim_idx, bool):
        raise ValueError(f"batch_dim_idx must be 0 ([batch, seq, heads, head_dim]) or 1 ([seq, batch, heads, head_dim]), "
                         f"got {batch_dim_idx!r}")
    if ndim != 4:
        raise ValueError(f"with batch_dim_idx the inputs must be 4-D [batch, seq, heads, head_dim] or "
                         f"[seq, batch, heads, head_dim], got a {ndim}-D tensor")
    seq = 1 - batch_dim_idx
    if (scatter >= 2) == (gather >= 2):
        raise ValueError(f"with batch_dim_idx one of scatter_idx/gather_idx must be the heads dimension (>= 2) and the "
                         f"other below 2, got scatter_idx={scatter_idx}, gather_idx={gather_idx}")
    return (scatter, seq) if scatter >= 2 else (seq, gather)


def _all_to_all(input_: torch.Tensor, scatter: int, gather: int, group, world: int) -> torch.Tensor:
    """Split ``input_`` in ``world`` blocks along ``scatter``, send block ``j`` to rank ``j``, and
    concatenate the blocks received along ``gather`` in rank order."""
    shape = list(input_.shape)
    if shape[scatter] % world:
        raise ValueError(f"sequence all-to-all: dimension {scatter} of the input (size {shape[scatter]}, input shape "
                         f"{tuple(shape)}) must be divisible by the sequence-parallel group size {world}")
    if world == 1:
        return input_.clone()
    block = shape[scatter] // world
    # [..., world, block, ...] with the block index first: all_to_all_single exchanges dimension 0
    send = input_.reshape([*shape[:scatter], world, block, *shape[scatter + 1:]]).movedim(scatter, 0).contiguous()
    received = torch.empty_like(send)
    ds_comm.all_to_all_single(received, send, group=group)
    # received[i] is rank i's block: put the rank index just before ``gather`` and merge the two
    local = [*shape[:scatter], block, *shape[scatter + 1:]]
    merged = [*local[:gather], world * local[gather], *local[gather + 1:]]
    return received.movedim(0, gather).reshape(merged)


class SeqAllToAll(torch.autograd.Function):
    """The differentiable sequence all-to-all (DeepSpeed's ``_SeqAllToAll``): forward scatters
    ``scatter_idx`` and gathers ``gather_idx``; backward is the reverse exchange. Call it as DeepSpeed
    does, ``SeqAllToAll.apply(group, input, scatter_idx, gather_idx, batch_dim_idx)``; the
    communication goes through ``ds_comm.all_to_all_single`` (seen by the comms logger)."""

    @staticmethod
    def forward(ctx: Any, group, input_: torch.Tensor, scatter_idx: int, gather_idx: int,
                batch_dim_idx: int | None = None, *overlap) -> torch.Tensor:
        # DeepSpeed's trailing (stream, handle, type, is_fwd, num_kv_heads): only the plain exchange is built
        if len(overlap) > 5:
            raise ValueError(f"SeqAllToAll.apply takes at most 10 arguments, got {5 + len(overlap)}")
        if any(arg is not None for arg in overlap[:2]):
            raise NotImplementedError("SeqAllToAll: the overlapped all-to-all (a stream or handle) is not built")
        world = _group_size(group)
        scatter, gather = _resolve_dims(input_.dim(), scatter_idx, gather_idx, batch_dim_idx)
        ctx.group, ctx.world, ctx.dims = group, world, (scatter, gather)
        ctx.num_extra = len(overlap)
        return _all_to_all(input_, scatter, gather, group, world)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        scatter, gather = ctx.dims
        grad = SeqAllToAll.apply(ctx.group, grad_output.contiguous(), gather, scatter)
        return (None, grad, None, None, None, *(None,) * ctx.num_extra)


def seq_all_to_all(input_: torch.Tensor, scatter_idx: int, gather_idx: int, group=None,
                   batch_dim_idx: int | None = None) -> torch.Tensor:
    """Differentiable all-to-all over ``group`` (None: the default group): split ``scatter_idx`` in
    group-size blocks, one to each rank, and concatenate what arrives along ``gather_idx``."""
    return SeqAllToAll.apply(group, input_, scatter_idx, gather_idx, batch_dim_idx)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    head, rest = t[..., :rot], t[..., rot:]
    head = head * cos + _rotate_half(head) * sin
    return head if rest.shape[-1] == 0 else torch.cat((head, rest), dim=-1)


class DistributedAttention(torch.nn.Module):
    """Ulysses attention over ``sequence_process_group`` (DeepSpeed's class of the same name).

    ``local_attention(q, k, v, *args, **kwargs)`` is any callable (an SDPA wrapper, a module,
    block-sparse attention) taking and returning the head-sharded layout, e.g.
    ``[batch, seq, heads/P, head_dim]`` for ``batch_dim_idx=0``. ``forward(query, key, value,
    batch_dim_idx=None, rotary_pos_emb=None, *args, **kwargs)`` takes each rank's slice of the
    sequence with every head and returns the attention output in the same layout. The head counts
    of q, k and v (k/v may have fewer: grouped-query attention) must be divisible by the group size.
    ``rotary_pos_emb``: DeepSpeed's ``(cos, sin)`` pair, applied to q and k after the exchange (the
    whole sequence), each permuted ``(1, 0, 2, 3)`` as DeepSpeed does.
    """

    def __init__(self, local_attention, sequence_process_group, scatter_idx: int = 2, gather_idx: int = 0,
                 sp_stream=None, num_kv_heads: int | None = None) -> None:
        super().__init__()
        if not callable(local_attention):
            raise ValueError(f"local_attention must be a callable (q, k, v, ...) -> output, got "
                             f"{type(local_attention).__name__}")
        for name, value in (("scatter_idx", scatter_idx), ("gather_idx", gather_idx)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int dimension, got {value!r}")
        if scatter_idx == gather_idx:
            raise ValueError(f"scatter_idx and gather_idx must differ, got {scatter_idx} for both")
        if sp_stream is not None:
            raise NotImplementedError("DistributedAttention: sp_stream (overlapping the all-to-alls on a side "
                                      "stream) is not built")
        if num_kv_heads is not None and (not isinstance(num_kv_heads, int) or num_kv_heads < 1):
            raise ValueError(f"num_kv_heads must be a positive int or None, got {num_kv_heads!r}")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = None
        self.num_kv_heads = num_kv_heads

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int | None = None,
                rotary_pos_emb=None, *args: Any, **kwargs: Any) -> torch.Tensor:
        world = _group_size(self.spg)
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"DistributedAttention: {name} must be a tensor, got {type(tensor).__name__}")
            scatter, _ = _resolve_dims(tensor.dim(), self.scatter_idx, self.gather_idx, batch_dim_idx)
            heads = tensor.shape[scatter]
            if heads % world:
                raise ValueError(f"DistributedAttention: the number of {name} heads ({heads}, dimension {scatter} of "
                                 f"shape {tuple(tensor.shape)}) must be divisible by the sequence-parallel group "
                                 f"size ({world})")
        if self.num_kv_heads is not None and self.num_kv_heads % world:
            raise ValueError(f"DistributedAttention: num_kv_heads ({self.num_kv_heads}) must be divisible by the "
                             f"sequence-parallel group size ({world}); uneven head partitions are not built")
        q = SeqAllToAll.apply(self.spg, query, self.scatter_idx, self.gather_idx, batch_dim_idx)
        k = SeqAllToAll.apply(self.spg, key, self.scatter_idx, self.gather_idx, batch_dim_idx)
        v = SeqAllToAll.apply(self.spg, value, self.scatter_idx, self.gather_idx, batch_dim_idx)
        if rotary_pos_emb is not None:
            cos, sin = (f.permute(1, 0, 2, 3) for f in rotary_pos_emb)
            q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        if not isinstance(context, torch.Tensor):
            raise ValueError(f"DistributedAttention: local_attention must return a tensor, got "
                             f"{type(context).__name__}")
        return SeqAllToAll.apply(self.spg, context, self.gather_idx, self.scatter_idx, batch_dim_idx)
