"""Collectives, torch.distributed-shaped, checked, and recorded by the comms logger when it is on.

With the logger off a call costs its checks and one flag test over ``torch.distributed``'s own.
Every function takes ``group`` and ``async_op`` like torch's and returns what torch returns (a
work handle with ``wait()`` when ``async_op=True``).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .distributed import _require
from .logger import comms_logger

logger = logging.getLogger(__name__)

ReduceOp = dist.ReduceOp
P2POp = dist.P2POp

OPS = frozenset({
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
    "reduce_scatter_tensor", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "barrier", "monitored_barrier",
})
# What gloo can reduce; NCCL takes these too. Anything else fails with a message, not deep in C++.
_REDUCIBLE = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
              torch.int32, torch.int64, torch.bool}


def _issue(name: str, nbytes: int, group, tensors, call, async_op: bool):
    if not comms_logger.active:
        return call(async_op)
    return comms_logger.run(name, nbytes, group, tensors, call, async_op)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _check_tensor(call: str, tensor, name: str = "tensor") -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"ds_comm.{call}: {name} must be a torch.Tensor, got {type(tensor).__name__}")


def _check_reducible(call: str, tensor: torch.Tensor) -> None:
    _check_tensor(call, tensor)
    if tensor.dtype not in _REDUCIBLE:
        allowed = ", ".join(sorted(str(d).replace("torch.", "") for d in _REDUCIBLE))
        raise TypeError(f"ds_comm.{call}: cannot reduce a {tensor.dtype} tensor of shape {tuple(tensor.shape)}; "
                        f"reducible dtypes: {allowed}")


def _check_rank(call: str, what: str, rank: int, group) -> None:
    world = dist.get_world_size(group)
    members = dist.get_process_group_ranks(group) if group is not None else range(world)
    if rank not in members:
        raise ValueError(f"ds_comm.{call}: {what}={rank} is not a rank of the group (ranks {list(members)})")


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    _require("all_reduce")
    _check_reducible("all_reduce", tensor)
    return _issue("all_reduce", _nbytes(tensor), group, (tensor,),
                  lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a), async_op)


def all_reduce_coalesced(tensors: list[torch.Tensor], op=ReduceOp.SUM, group=None, async_op: bool = False):
    """All-reduce many tensors with one collective per dtype: they are flattened into one buffer,
    reduced, and copied back (DeepSpeed's coalesced all-reduce)."""
    _require("all_reduce_coalesced")
    for t in tensors:
        _check_reducible("all_reduce_coalesced", t)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    works = []
    for group_tensors in by_dtype.values():
        flat = _flatten_dense_tensors(group_tensors)
        work = _issue("all_reduce_coalesced", _nbytes(flat), group, (flat,),
                      lambda a, flat=flat: dist.all_reduce(flat, op=op, group=group, async_op=a), True)
        works.append((work, flat, group_tensors))

    def finish():
        for work, flat, group_tensors in works:
            if work is not None:
                work.wait()
            for dst, src in zip(group_tensors, _unflatten_dense_tensors(flat, group_tensors), strict=True):
                dst.copy_(src)

    if async_op:
        return _Deferred(finish)
    finish()
    return None


class _Deferred:
    """A work handle whose wait() finishes a composite operation."""

    def __init__(self, finish):
        self._finish, self._done = finish, False

    def wait(self, timeout=None):
        if not self._done:
            self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    _require("reduce")
    _check_reducible("reduce", tensor)
    _check_rank("reduce", "dst", dst, group)
    return _issue("reduce", _nbytes(tensor), group, (tensor,),
                  lambda a: dist.reduce(tensor, dst, op=op, group=group, async_op=a), async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    _require("broadcast")
    _check_tensor("broadcast", tensor)
    _check_rank("broadcast", "src", src, group)
    return _issue("broadcast", _nbytes(tensor), group, (tensor,),
                  lambda a: dist.broadcast(tensor, src, group=group, async_op=a), async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False):
    _require("all_gather")
    _check_tensor("all_gather", tensor)
    world = dist.get_world_size(group)
    if len(tensor_list) != world or any(t.shape != tensor.shape or t.dtype != tensor.dtype for t in tensor_list):
        shapes = [tuple(t.shape) for t in tensor_list]
        raise ValueError(f"ds_comm.all_gather: tensor_list must hold {world} tensors of shape {tuple(tensor.shape)} "
                         f"and dtype {tensor.dtype}, got shapes {shapes}")
    return _issue("all_gather", _nbytes(tensor) * world, group, (tensor,),
                  lambda a: dist.all_gather(tensor_list, tensor, group=group, async_op=a), async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Gather ``input`` of every rank into ``output`` (rank order). Backends without the native
    collective get a fallback through ``all_gather`` into views of ``output``."""
    _require("all_gather_into_tensor")
    _check_tensor("all_gather_into_tensor", output, "output")
    _check_tensor("all_gather_into_tensor", input, "input")
    world = dist.get_world_size(group)
    if output.numel() != input.numel() * world or output.dtype != input.dtype:
        raise ValueError(f"ds_comm.all_gather_into_tensor: output must hold world_size ({world}) × input "
                         f"({input.numel()} elements, {input.dtype}) = {input.numel() * world} elements, got "
                         f"{output.numel()} elements of {output.dtype}")
    return _issue("all_gather_into_tensor", _nbytes(output), group, (output, input),
                  lambda a: _native_or_fallback(dist.all_gather_into_tensor, _all_gather_fallback,
                                                output, input, group, a), async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """Reduce ``input`` across ranks and keep this rank's chunk in ``output``. Backends without the
    native collective (gloo before it gained one) get a fallback: an all-reduce of a copy of
    ``input``, then this rank's chunk copied out (twice the traffic, same result)."""
    _require("reduce_scatter_tensor")
    _check_reducible("reduce_scatter_tensor", input)
    _check_tensor("reduce_scatter_tensor", output, "output")
    world = dist.get_world_size(group)
    if input.numel() != output.numel() * world or output.dtype != input.dtype:
        raise ValueError(f"ds_comm.reduce_scatter_tensor: input must hold world_size ({world}) × output "
                         f"({output.numel()} elements, {output.dtype}) = {output.numel() * world} elements, got "
                         f"{input.numel()} elements of {input.dtype}")
    return _issue("reduce_scatter_tensor", _nbytes(input), group, (output, input),
                  lambda a: _native_or_fallback(lambda o, i, group, async_op: dist.reduce_scatter_tensor(
                      o, i, op=op, group=group, async_op=async_op),
                      lambda o, i, group, async_op: _reduce_scatter_fallback(o, i, op, group, async_op),
                      output, input, group, a), async_op)


_FALLBACK_USED: set[str] = set()


def _native_or_fallback(native, fallback, output, input, group, async_op):
    backend = dist.get_backend(group)
    if backend in _FALLBACK_USED:
        return fallback(output, input, group=group, async_op=async_op)
    try:
        return native(output, input, group=group, async_op=async_op)
    except (RuntimeError, NotImplementedError) as e:  # the backend lacks it: the same on every rank
        if "not supported" not in str(e).lower() and "not implemented" not in str(e).lower():
            raise
        logger.warning("ds_comm: backend %s lacks %s; using the fallback from now on", backend, native.__name__)
        _FALLBACK_USED.add(backend)
        return fallback(output, input, group=group, async_op=async_op)


def _all_gather_fallback(output, input, group=None, async_op=False):
    world = dist.get_world_size(group)
    return dist.all_gather(list(output.view(-1).chunk(world)), input.reshape(-1), group=group, async_op=async_op)


def _reduce_scatter_fallback(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    reduced = input.detach().clone().reshape(-1)
    work = dist.all_reduce(reduced, op=op, group=group, async_op=True)

    def finish():
        work.wait()
        output.view(-1).copy_(reduced.chunk(world)[rank])

    if async_op:
        return _Deferred(finish)
    finish()
    return None


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False):
    _require("all_to_all_single")
    _check_tensor("all_to_all_single", output, "output")
    _check_tensor("all_to_all_single", input, "input")
    world = dist.get_world_size(group)
    if input_split_sizes is None and output_split_sizes is None and (
            input.shape[0] % world or output.shape != input.shape):
        raise ValueError(f"ds_comm.all_to_all_single: without split sizes, input and output must have the same "
                         f"shape with a first dimension divisible by the world size {world}; got input "
                         f"{tuple(input.shape)}, output {tuple(output.shape)}")
    for name, splits in (("input_split_sizes", input_split_sizes), ("output_split_sizes", output_split_sizes)):
        if splits is not None and len(splits) != world:
            raise ValueError(f"ds_comm.all_to_all_single: {name} must have {world} entries, got {list(splits)}")
    return _issue("all_to_all_single", _nbytes(input), group, (output, input),
                  lambda a: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                   group=group, async_op=a), async_op)


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    _require("send")
    _check_tensor("send", tensor)
    _check_rank("send", "dst", dst, group)
    return _issue("send", _nbytes(tensor), group, (tensor,),
                  lambda a: dist.send(tensor, dst, group=group, tag=tag), False)


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0):
    _require("recv")
    _check_tensor("recv", tensor)
    if src is not None:
        _check_rank("recv", "src", src, group)
    return _issue("recv", _nbytes(tensor), group, (tensor,),
                  lambda a: dist.recv(tensor, src, group=group, tag=tag), False)


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    _require("isend")
    _check_tensor("isend", tensor)
    _check_rank("isend", "dst", dst, group)
    return _issue("isend", _nbytes(tensor), group, (tensor,),
                  lambda a: dist.isend(tensor, dst, group=group, tag=tag), True)


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0):
    _require("irecv")
    _check_tensor("irecv", tensor)
    return _issue("irecv", _nbytes(tensor), group, (tensor,),
                  lambda a: dist.irecv(tensor, src, group=group, tag=tag), True)


def batch_isend_irecv(p2p_op_list: list[P2POp]):
    _require("batch_isend_irecv")
    total = sum(_nbytes(op.tensor) for op in p2p_op_list)
    return _issue("batch_isend_irecv", total, None, [op.tensor for op in p2p_op_list],
                  lambda a: dist.batch_isend_irecv(p2p_op_list), True)


def barrier(group=None, async_op: bool = False):
    _require("barrier")
    return _issue("barrier", 0, group, (), lambda a: dist.barrier(group=group, async_op=a), async_op)


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False):
    """gloo's barrier that names the ranks that did not arrive within ``timeout``."""
    _require("monitored_barrier")
    return _issue("monitored_barrier", 0, group, (),
                  lambda a: dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks), False)
