"""Collectives, torch.distributed-shaped, checked, and recorded by the comms logger when it is on.

With the logger off a call costs its checks and one flag test over ``torch.distributed``'s own.
Every function takes ``group`` and ``async_op`` like torch's and returns what torch returns (a
work handle with ``wait()`` when ``async_op=True``). A handle of an op made of several backend
works (the coalesced all-reduce, gloo's reduce-scatter and all-gather paths) is a `_Composite`:
``is_completed()`` is true only once the whole op is done, ``wait(timeout)`` honours its timeout.

On gloo, ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` take faster paths than torch's
own, which copy the whole buffer per call (measured on 2 ranks: see benchmarks/bench_buckets.py):
a reduce-scatter is an all-to-all into a reused staging buffer and a local reduction (half the
traffic of gloo's all-reduce-based one, no allocation), an all-gather is one in-place broadcast per
rank into the output (no allocation, no copy).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from . import distributed as _distributed
from ._ops import OPS  # noqa: F401  (re-exported: ds_comm.collectives.OPS is where it used to be)
from .distributed import _require_usable
from .logger import _no_limit, _seconds, comms_logger

logger = logging.getLogger(__name__)

ReduceOp = dist.ReduceOp
P2POp = dist.P2POp

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


def _check_contiguous(call: str, tensor: torch.Tensor, name: str) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"ds_comm.{call}: {name} must be contiguous (it is used in place), got a tensor of "
                         f"shape {tuple(tensor.shape)} with strides {tensor.stride()}")


def _check_rank(call: str, what: str, rank: int, group) -> None:
    world = dist.get_world_size(group)
    members = dist.get_process_group_ranks(group) if group is not None else range(world)
    if rank not in members:
        raise ValueError(f"ds_comm.{call}: {what}={rank} is not a rank of the group (ranks {list(members)})")


def _global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _backend_for(group, tensor: torch.Tensor) -> str:
    """The backend that moves ``tensor`` in ``group`` ("gloo" for CPU tensors of "cpu:gloo,cuda:nccl")."""
    backend = str(dist.get_backend(group))
    if ":" not in backend:
        return backend
    pairs = dict(part.split(":", 1) for part in backend.split(","))
    return pairs.get(tensor.device.type, backend)


# ---- handles ----------------------------------------------------------------------------------------

class _Composite:
    """The handle of an op made of backend works and, optionally, a local step (a reduction, a
    copy-back) run once they are all complete. Where the works have futures the step runs in their
    completion callback, off the caller's thread, so it overlaps the caller's compute; otherwise it
    runs in the first ``wait()`` or ``is_completed()`` that finds the works done."""

    def __init__(self, works: list, finish: Callable[[], None] | None = None):
        self._works, self._finish, self._done = works, finish, False
        try:
            futures = [w.get_future() for w in works]
        except (RuntimeError, AttributeError, NotImplementedError):  # e.g. gloo's send/recv
            futures = None
        self._future = None
        if futures:
            done = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)
            self._future = done.then(self._callback) if finish is not None else done

    def _callback(self, future):
        future.value()  # a failed work: the failure, not the step, is what wait() reports
        self._finish()

    def wait(self, timeout=None) -> bool:
        if _no_limit(timeout):
            for work in self._works:
                work.wait()
        else:  # the limit is for the whole op
            limit = _seconds(timeout)
            deadline = time.monotonic() + limit
            for work in self._works:
                left = deadline - time.monotonic()
                if left <= 0 and not work.is_completed():
                    raise RuntimeError(f"ds_comm: the operation timed out after {limit:g} s")
                work.wait(timedelta(seconds=max(left, 1e-3)))
        if self._future is not None:
            self._future.wait()  # the step is local and short; this also re-raises its failure
        elif not self._done:
            self._run_finish()
        return True

    def is_completed(self) -> bool:
        if self._future is not None:
            return self._future.done()
        if not self._done and all(w.is_completed() for w in self._works):
            self._run_finish()
        return self._done

    def _run_finish(self) -> None:
        self._done = True
        if self._finish is not None:
            self._finish()

    def get_future(self):
        if self._future is None:
            raise RuntimeError("ds_comm: this backend's works have no futures")
        return self._future


# ---- staging buffers --------------------------------------------------------------------------------

class _Staging:
    """Reused staging buffers per (device, dtype): taken when an op starts, given back when it ends
    (possibly in a completion callback, hence the lock), freed when the default group is destroyed.
    A buffer is allocated only when no free one is large enough, so steady training allocates none."""

    KEEP = 4  # free buffers kept per (device, dtype); beyond that the smallest is dropped

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (device, dtype)
        with self._lock:
            free = self._free.get(key, [])
            fitting = [i for i, b in enumerate(free) if b.numel() >= numel]
            if fitting:  # (by index: list.remove would compare tensors elementwise)
                return free.pop(min(fitting, key=lambda i: free[i].numel()))
        return torch.empty(numel, dtype=dtype, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        """Return ``buffer`` after its last use. A CUDA buffer is not pooled: its last use may be
        queued on another stream (a completion callback runs on a stream ordered after the
        collective), which this pool cannot see; it goes back to torch's caching allocator, told
        about that stream, which reuses the memory only once the queued work is done."""
        if buffer.is_cuda:
            buffer.record_stream(torch.cuda.current_stream(buffer.device))
            return
        with self._lock:
            free = self._free.setdefault((buffer.device, buffer.dtype), [])
            free.append(buffer)
            if len(free) > self.KEEP:
                free.pop(min(range(len(free)), key=lambda i: free[i].numel()))

    def clear(self) -> None:
        with self._lock:
            self._free.clear()

    def held_bytes(self) -> int:
        with self._lock:
            return sum(_nbytes(b) for free in self._free.values() for b in free)


_staging = _Staging()
_distributed._on_teardown(_staging.clear)


# ---- all-reduce -------------------------------------------------------------------------------------

def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    _require_usable("all_reduce")
    _check_reducible("all_reduce", tensor)
    return _issue("all_reduce", _nbytes(tensor), group, (tensor,),
                  lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a), async_op)


def inference_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None):
    """DeepSpeed's all-reduce for inference (tensor-parallel layers): `all_reduce`, in place, waited for."""
    return all_reduce(tensor, op=op, group=group)


def all_reduce_coalesced(tensors: list[torch.Tensor], op=ReduceOp.SUM, group=None, async_op: bool = False):
    """All-reduce many tensors with one collective per dtype and device (DeepSpeed's coalesced
    all-reduce). Tensors that are contiguous views filling one stretch of one buffer back to back
    (gradients living in a flat bucket) are reduced in that buffer: no copy at all. Others are
    copied into a reused staging buffer, reduced, and copied back; no allocation once warm."""
    _require_usable("all_reduce_coalesced")
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"ds_comm.all_reduce_coalesced: tensors must be a list of tensors, got {type(tensors).__name__}")
    for t in tensors:
        _check_reducible("all_reduce_coalesced", t)
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    works, staged = [], []
    for (device, dtype), members in by_kind.items():
        flat = _covering_view(members)
        if flat is None:
            total = sum(t.numel() for t in members)
            buffer = _staging.take(total, dtype, device)
            flat = buffer[:total]
            slices = _slices(flat, members)
            torch._foreach_copy_(slices, members)
            staged.append((buffer, slices, members))
        works.append(_issue("all_reduce_coalesced", _nbytes(flat), group, (flat,),
                            lambda a, flat=flat: dist.all_reduce(flat, op=op, group=group, async_op=a), True))

    def copy_back():
        for buffer, slices, members in staged:
            torch._foreach_copy_(members, slices)
            _staging.give_back(buffer)

    handle = _Composite([w for w in works if w is not None], copy_back if staged else None)
    if async_op:
        return handle
    handle.wait()
    return None


def _covering_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat view over ``tensors`` if they are contiguous and fill one stretch of one storage
    back to back (in any order), else None."""
    first = tensors[0]
    base = first.untyped_storage().data_ptr()
    if any(not t.is_contiguous() or t.untyped_storage().data_ptr() != base for t in tensors):
        return None
    ordered = sorted(tensors, key=torch.Tensor.storage_offset)
    start = end = ordered[0].storage_offset()
    for t in ordered:
        if t.storage_offset() != end:  # a gap (not ours to reduce) or an overlap
            return None
        end += t.numel()
    return first.detach().as_strided((end - start,), (1,), start)


def _slices(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    _require_usable("reduce")
    _check_reducible("reduce", tensor)
    _check_rank("reduce", "dst", dst, group)
    return _issue("reduce", _nbytes(tensor), group, (tensor,),
                  lambda a: dist.reduce(tensor, dst, op=op, group=group, async_op=a), async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    _require_usable("broadcast")
    _check_tensor("broadcast", tensor)
    _check_rank("broadcast", "src", src, group)
    return _issue("broadcast", _nbytes(tensor), group, (tensor,),
                  lambda a: dist.broadcast(tensor, src, group=group, async_op=a), async_op)


# ---- all-gather -------------------------------------------------------------------------------------

def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False):
    _require_usable("all_gather")
    _check_tensor("all_gather", tensor)
    world = dist.get_world_size(group)
    if len(tensor_list) != world or any(t.shape != tensor.shape or t.dtype != tensor.dtype for t in tensor_list):
        shapes = [tuple(t.shape) for t in tensor_list]
        raise ValueError(f"ds_comm.all_gather: tensor_list must hold {world} tensors of shape {tuple(tensor.shape)} "
                         f"and dtype {tensor.dtype}, got shapes {shapes}")
    return _issue("all_gather", _nbytes(tensor) * world, group, (tensor,),
                  lambda a: dist.all_gather(tensor_list, tensor, group=group, async_op=a), async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Gather ``input`` of every rank into ``output`` (rank order). On gloo: ``input`` is copied
    into this rank's chunk of ``output`` (nothing if it already is that chunk), then every chunk
    is broadcast in place from its rank."""
    _require_usable("all_gather_into_tensor")
    _check_tensor("all_gather_into_tensor", output, "output")
    _check_tensor("all_gather_into_tensor", input, "input")
    world = dist.get_world_size(group)
    if output.numel() != input.numel() * world or output.dtype != input.dtype:
        raise ValueError(f"ds_comm.all_gather_into_tensor: output must hold world_size ({world}) × input "
                         f"({input.numel()} elements, {input.dtype}) = {input.numel() * world} elements, got "
                         f"{output.numel()} elements of {output.dtype}")
    _check_contiguous("all_gather_into_tensor", output, "output")
    return _issue("all_gather_into_tensor", _nbytes(output), group, (output, input),
                  lambda a: _all_gather(output, input, group, a), async_op)


def all_gather_bucket(flat_output: torch.Tensor, input_shard: torch.Tensor | None = None, group=None,
                      async_op: bool = False):
    """All-gather into a caller-owned flat bucket: afterwards ``flat_output`` holds every rank's shard,
    rank r's at elements ``[r*n, (r+1)*n)`` with ``n = flat_output.numel() // world_size``.

    Made for ZeRO-3's parameter buckets (as FSDP2's all-gather): this rank's shard lives inside the
    bucket, so by default (``input_shard=None``) the gather is in place, with no copy and, on gloo
    and NCCL, no allocation. ``input_shard`` (n elements) is copied into this rank's place first.
    Returns a work handle with ``async_op=True``."""
    _require_usable("all_gather_bucket")
    _check_tensor("all_gather_bucket", flat_output, "flat_output")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_flat("all_gather_bucket", flat_output, "flat_output", world)
    mine = flat_output.view(world, -1)[rank]
    if input_shard is None:
        input_shard = mine
    else:
        _check_tensor("all_gather_bucket", input_shard, "input_shard")
        if input_shard.numel() != mine.numel() or input_shard.dtype != flat_output.dtype:
            raise ValueError(f"ds_comm.all_gather_bucket: input_shard must hold flat_output's "
                             f"{flat_output.numel()} elements / world_size {world} = {mine.numel()} elements of "
                             f"{flat_output.dtype}, got {input_shard.numel()} elements of {input_shard.dtype}")
    return _issue("all_gather_bucket", _nbytes(flat_output), group, (flat_output,),
                  lambda a: _all_gather(flat_output, input_shard, group, a), async_op)


def _check_flat(call: str, tensor: torch.Tensor, name: str, world: int) -> None:
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(f"ds_comm.{call}: {name} must be a flat (1-D, contiguous) buffer, got shape "
                         f"{tuple(tensor.shape)} with strides {tensor.stride()}")
    if tensor.numel() % world:
        raise ValueError(f"ds_comm.{call}: {name} must hold a multiple of the world size {world} elements "
                         f"(pad the bucket), got {tensor.numel()}")


def _all_gather(output, input, group, async_op):
    if _backend_for(group, output) == "gloo":
        return _all_gather_broadcasts(output, input, group, async_op)
    return _native_or_fallback(dist.all_gather_into_tensor, _all_gather_broadcasts, output, input, group, async_op)


def _all_gather_broadcasts(output, input, group=None, async_op=False):
    """All-gather as one broadcast per rank, each in place into its chunk of ``output``: no
    allocation (gloo's own all_gather_into_tensor allocates two output-sized buffers per call)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = output.view(world, -1)
    if input.data_ptr() != chunks[rank].data_ptr():
        chunks[rank].view(input.shape).copy_(input)
    works = [dist.broadcast(chunks[r], _global_rank(group, r), group=group, async_op=True) for r in range(world)]
    handle = _Composite(works)
    if async_op:
        return handle
    handle.wait()
    return None


# ---- reduce-scatter ---------------------------------------------------------------------------------

def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """Reduce ``input`` across ranks and keep this rank's chunk in ``output``. On gloo (and on a
    backend without the native collective): an all-to-all into a reused staging buffer, then the
    chunks are reduced locally into ``output``; ``input`` is left unchanged."""
    _require_usable("reduce_scatter_tensor")
    _check_reducible("reduce_scatter_tensor", input)
    _check_tensor("reduce_scatter_tensor", output, "output")
    world = dist.get_world_size(group)
    if input.numel() != output.numel() * world or output.dtype != input.dtype:
        raise ValueError(f"ds_comm.reduce_scatter_tensor: input must hold world_size ({world}) × output "
                         f"({output.numel()} elements, {output.dtype}) = {output.numel() * world} elements, got "
                         f"{input.numel()} elements of {input.dtype}")
    _check_contiguous("reduce_scatter_tensor", input, "input")
    _check_contiguous("reduce_scatter_tensor", output, "output")
    return _issue("reduce_scatter_tensor", _nbytes(input), group, (output, input),
                  lambda a: _reduce_scatter(output, input, op, group, a, None), async_op)


def reduce_scatter_bucket(flat_input: torch.Tensor, output_shard: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False, *, staging: torch.Tensor | None = None):
    """Reduce-scatter a caller-owned flat bucket: ``output_shard`` (n elements) receives the reduction
    over ranks of elements ``[r*n, (r+1)*n)`` of ``flat_input``, r being this rank in ``group``.

    Made for ZeRO's gradient buckets (as FSDP2's reduce-scatter): gradients are views into
    ``flat_input``, the shard is a view into the rank's flat partition, and nothing is allocated or
    copied back per call. ``output_shard`` may be this rank's own chunk of ``flat_input`` (in place).
    ``flat_input`` is left unchanged. On gloo the data goes through an all-to-all into a staging
    buffer of ``flat_input``'s size: pass ``staging`` (at least that many elements, same dtype) to
    own it, else ds_comm reuses one of its own. Returns a work handle with ``async_op=True``."""
    _require_usable("reduce_scatter_bucket")
    _check_tensor("reduce_scatter_bucket", flat_input, "flat_input")
    _check_reducible("reduce_scatter_bucket", flat_input)
    _check_tensor("reduce_scatter_bucket", output_shard, "output_shard")
    world = dist.get_world_size(group)
    _check_flat("reduce_scatter_bucket", flat_input, "flat_input", world)
    n = flat_input.numel() // world
    if output_shard.numel() != n or output_shard.dtype != flat_input.dtype:
        raise ValueError(f"ds_comm.reduce_scatter_bucket: output_shard must hold flat_input's {flat_input.numel()} "
                         f"elements / world_size {world} = {n} elements of {flat_input.dtype}, got "
                         f"{output_shard.numel()} elements of {output_shard.dtype}")
    _check_contiguous("reduce_scatter_bucket", output_shard, "output_shard")
    if staging is not None:
        _check_tensor("reduce_scatter_bucket", staging, "staging")
        if staging.numel() < flat_input.numel() or staging.dtype != flat_input.dtype or not staging.is_contiguous():
            raise ValueError(f"ds_comm.reduce_scatter_bucket: staging must be a contiguous {flat_input.dtype} buffer "
                             f"of at least {flat_input.numel()} elements, got {staging.numel()} elements of "
                             f"{staging.dtype}")
    return _issue("reduce_scatter_bucket", _nbytes(flat_input), group, (output_shard, flat_input),
                  lambda a: _reduce_scatter(output_shard, flat_input, op, group, a, staging), async_op)


def _local_reduction(op, dtype: torch.dtype) -> Callable | None:
    """``fn(chunks [world, n], out [n])`` reducing over ranks like ``op``, or None if only the
    backend can (bitwise ops, PREMUL_SUM, bool)."""
    if dtype == torch.bool:
        return None
    if op == ReduceOp.SUM:
        return lambda x, out: torch.sum(x, dim=0, dtype=x.dtype, out=out)
    if op == ReduceOp.AVG and dtype.is_floating_point:
        return lambda x, out: torch.sum(x, dim=0, dtype=x.dtype, out=out).div_(x.shape[0])
    if op == ReduceOp.MAX:
        return lambda x, out: torch.amax(x, dim=0, out=out)
    if op == ReduceOp.MIN:
        return lambda x, out: torch.amin(x, dim=0, out=out)
    if op == ReduceOp.PRODUCT:
        return lambda x, out: torch.prod(x, dim=0, dtype=x.dtype, out=out)
    return None


def _reduce_scatter(output, input, op, group, async_op, staging):
    reduction = _local_reduction(op, input.dtype)
    if reduction is not None and _backend_for(group, input) == "gloo":
        return _reduce_scatter_all_to_all(output, input, reduction, group, async_op, staging)

    def fallback(o, i, group=None, async_op=False):
        if reduction is None:
            raise RuntimeError(f"ds_comm.reduce_scatter_tensor: backend {dist.get_backend(group)} has no "
                               f"reduce-scatter and {op} cannot be reduced locally")
        return _reduce_scatter_all_to_all(o, i, reduction, group, async_op, staging)

    return _native_or_fallback(lambda o, i, group, async_op: dist.reduce_scatter_tensor(
        o, i, op=op, group=group, async_op=async_op), fallback, output, input, group, async_op)


def _reduce_scatter_all_to_all(output, input, reduction, group=None, async_op=False, staging=None):
    """Reduce-scatter as an all-to-all (rank r receives every rank's chunk r: each rank sends
    (world-1)/world of the input, as a ring reduce-scatter does) into a staging buffer, then a local
    reduction into ``output``. No allocation once the staging buffer is warm, ``input`` untouched."""
    world = dist.get_world_size(group)
    n = output.numel()
    owned = staging is None
    buffer = _staging.take(world * n, input.dtype, input.device) if owned else staging
    received = buffer[:world * n]
    work = dist.all_to_all_single(received, input.view(-1), group=group, async_op=True)

    def finish():
        reduction(received.view(world, n), output.view(-1))
        if owned:
            _staging.give_back(buffer)

    handle = _Composite([work], finish)
    if async_op:
        return handle
    handle.wait()
    return None


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
        logger.warning("ds_comm: backend %s lacks %s; using the fallback from now on", backend,
                       getattr(native, "__name__", "the collective"))
        _FALLBACK_USED.add(backend)
        return fallback(output, input, group=group, async_op=async_op)


# ---- all-to-all, point to point, barriers -----------------------------------------------------------

def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False):
    _require_usable("all_to_all_single")
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
    _require_usable("send")
    _check_tensor("send", tensor)
    _check_rank("send", "dst", dst, group)
    return _issue("send", _nbytes(tensor), group, (tensor,),
                  lambda a: dist.send(tensor, dst, group=group, tag=tag), False)


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0):
    _require_usable("recv")
    _check_tensor("recv", tensor)
    if src is not None:
        _check_rank("recv", "src", src, group)
    return _issue("recv", _nbytes(tensor), group, (tensor,),
                  lambda a: dist.recv(tensor, src, group=group, tag=tag), False)


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    _require_usable("isend")
    _check_tensor("isend", tensor)
    _check_rank("isend", "dst", dst, group)
    return _issue("isend", _nbytes(tensor), group, (tensor,),
                  lambda a: dist.isend(tensor, dst, group=group, tag=tag), True)


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0):
    _require_usable("irecv")
    _check_tensor("irecv", tensor)
    return _issue("irecv", _nbytes(tensor), group, (tensor,),
                  lambda a: dist.irecv(tensor, src, group=group, tag=tag), True)


def batch_isend_irecv(p2p_op_list: list[P2POp]):
    """Issue the sends and receives together; returns their work handles, one per op (as torch)."""
    _require_usable("batch_isend_irecv")
    if not p2p_op_list or not all(isinstance(op, P2POp) for op in p2p_op_list):
        kinds = [type(op).__name__ for op in p2p_op_list] if isinstance(p2p_op_list, (list, tuple)) else p2p_op_list
        raise ValueError(f"ds_comm.batch_isend_irecv: p2p_op_list must be a non-empty list of P2POp, got {kinds!r}")
    total = sum(_nbytes(op.tensor) for op in p2p_op_list)
    return _issue("batch_isend_irecv", total, None, [op.tensor for op in p2p_op_list],
                  lambda a: dist.batch_isend_irecv(p2p_op_list), True)


def _exchange(op: str, nbytes: int, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
              group=None, tag: int = 0) -> list:
    """A collective made of point-to-point messages, so that the caller can work while they travel:
    ``recvs`` and ``sends`` ((tensor, group rank) each) issued together, recorded by the comms logger
    as one ``op`` of ``nbytes`` (the collective's own message size: its bus bytes are what each rank
    sends). Returns the works, one per receive then one per send, in order; wait on every one."""
    ops = [P2POp(dist.irecv, t, _global_rank(group, src), group, tag) for t, src in recvs]
    ops += [P2POp(dist.isend, t, _global_rank(group, dst), group, tag) for t, dst in sends]
    if not ops:
        return []
    return _issue(op, nbytes, group, [t for t, _ in recvs + sends], lambda a: dist.batch_isend_irecv(ops), True)


def barrier(group=None, async_op: bool = False):
    _require_usable("barrier")
    return _issue("barrier", 0, group, (), lambda a: dist.barrier(group=group, async_op=a), async_op)


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False):
    """gloo's barrier that names the ranks that did not arrive within ``timeout``."""
    _require_usable("monitored_barrier")
    return _issue("monitored_barrier", 0, group, (),
                  lambda a: dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks), False)
