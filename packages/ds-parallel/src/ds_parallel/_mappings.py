"""Megatron's four autograd functions between tensor-parallel regions.

Each is ``f(input_, group=None)``: ``group`` is the tensor-parallel process group (None: the
default group). With one rank in the group (or no process group at all and ``group=None``)
each is the identity, as in Megatron. Collectives go through ds_comm, so the comms logger sees them.

=============================================  ======================  ==========================
function                                       forward                 backward
=============================================  ======================  ==========================
copy_to_tensor_model_parallel_region           identity                all-reduce (sum)
reduce_from_tensor_model_parallel_region       all-reduce (sum)        identity
scatter_to_tensor_model_parallel_region        keep own last-dim chunk all-gather last dim
gather_from_tensor_model_parallel_region       all-gather last dim     keep own last-dim chunk
=============================================  ======================  ==========================
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import ds_comm


def _world(group) -> int:
    if group is None and not dist.is_initialized():
        return 1
    return ds_comm.get_world_size(group)


def _rank(group) -> int:
    if group is None and not dist.is_initialized():
        return 0
    return ds_comm.get_rank(group)


def _all_reduce(input_: torch.Tensor, group) -> torch.Tensor:
    if _world(group) == 1:
        return input_
    out = input_.clone(memory_format=torch.contiguous_format)  # never reduce the caller's tensor in place
    ds_comm.all_reduce(out, group=group)
    return out


def _split_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return input_
    last = input_.size(-1)
    if last % world:
        raise ValueError(f"ds_parallel: the last dimension ({last}) of a tensor of shape {tuple(input_.shape)} is "
                         f"not divisible by the tensor-parallel world size {world}")
    chunk = last // world
    return input_.narrow(-1, _rank(group) * chunk, chunk).contiguous()


def _gather_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return input_
    local = input_.contiguous()
    out = torch.empty((world, *local.shape), dtype=local.dtype, device=local.device)
    ds_comm.all_gather_into_tensor(out, local, group=group)
    # [world, ..., chunk] -> [..., world, chunk] -> [..., world * chunk]
    return out.movedim(0, -2).reshape(*local.shape[:-1], world * local.shape[-1]).contiguous()


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _all_reduce(grad_output, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        return _all_reduce(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_last_dim(grad_output, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_last_dim(grad_output, ctx.group), None


def _check(name: str, input_) -> None:
    if not isinstance(input_, torch.Tensor):
        raise TypeError(f"ds_parallel.{name}: input_ must be a torch.Tensor, got {type(input_).__name__}")


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient over ``group`` backward."""
    _check("copy_to_tensor_model_parallel_region", input_)
    return _CopyToModelParallelRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) over ``group`` forward; identity backward."""
    _check("reduce_from_tensor_model_parallel_region", input_)
    return _ReduceFromModelParallelRegion.apply(input_, group)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's chunk of the last dimension forward; all-gather the last dimension backward."""
    _check("scatter_to_tensor_model_parallel_region", input_)
    return _ScatterToModelParallelRegion.apply(input_, group)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather the last dimension over ``group`` (rank order) forward; keep this rank's chunk backward."""
    _check("gather_from_tensor_model_parallel_region", input_)
    return _GatherFromModelParallelRegion.apply(input_, group)
