"""1-bit compressed all-reduce with error feedback (1-bit Adam, Tang et al. 2021).

Each rank ("worker") adds its error feedback, splits the tensor into one chunk per rank, and
compresses every chunk to sign bits (8 per byte) plus one scale (the chunk's RMS). An all-to-all
hands chunk i to rank i (the "server" of that chunk), which averages the decompressed chunks,
adds its own error feedback, and compresses the average again; an all-gather returns every
server's compressed chunk to everyone. The errors of both compressions are kept and added back
next time, so repeated calls average out to the exact mean. On the wire: about 1/32 of an fp32
all-reduce, plus a few scales.

The errors are kept lazily, in the caller's two buffers (*error states*): each holds the values it
last compressed (the input plus the error before it) followed by their chunks' scales; the error
they stand for, ``value - ±scale`` (``+scale`` where ``value >= 0``), is recomputed when the next
call reads them. So each compression is one pass over memory (it never writes the error itself),
and a zero buffer is no error.

A compressed chunk travels as one *frame*: its sign bits (`pack_signs`' layout) followed by its
scale as a float32 (native byte order), ``chunk / 8 + 4`` bytes. The all-to-all and the all-gather
are point-to-point messages issued together (one record each in the comms logger, named after the
collective, with its bytes), so that the work goes on while they travel: the frames for the other
ranks are compressed first and this rank's own while they are sent; this rank's chunk of the result
is decompressed while the other servers' frames arrive.

Two implementations produce the same frames and results: ds-ops' ``onebit`` kernels (one pass over
memory each, threaded, vectorised; used when ds-ops is installed, ``pip install ds-comm[ops]``, and
the tensors are contiguous CPU float32) and torch ops (any device and float dtype; what runs with
ds-comm alone). Both sum a chunk's squares in float64 and do every float32 operation in the same
order (the error ``value - ±scale``, then ``input + error``); only that sum's order differs, so a
scale could differ in its last bit in rare cases (the tests find them identical).
"""

from __future__ import annotations

import logging
import math
from types import ModuleType

import torch

from .collectives import _exchange, _staging
from .distributed import _require, get_rank, get_world_size

logger = logging.getLogger(__name__)

_SHIFTS = torch.arange(8, dtype=torch.uint8)
_SCALE_BYTES = 4  # a frame's scale: one float32 after the sign bytes
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_TAG = 0x1B17  # the point-to-point messages' tag, apart from a caller's own (gloo matches on it)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Sign bits of ``x`` (1 for >= 0), 8 per byte, least significant bit first. ``x.numel()``
    must be a multiple of 8."""
    if x.numel() % 8:
        raise ValueError(f"pack_signs: the element count must be a multiple of 8, got {x.numel()}")
    bits = (x.reshape(-1, 8) >= 0).to(torch.uint8)
    return (bits << _SHIFTS.to(x.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """±1 values from `pack_signs`' bytes."""
    bits = (packed.reshape(-1, 1) >> _SHIFTS.to(packed.device)) & 1
    return bits.reshape(-1).to(dtype) * 2 - 1


def compressed_allreduce(tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                         group=None, *, native: bool | None = None) -> torch.Tensor:
    """Average ``tensor`` over the ranks with 1-bit compression and error feedback; the result is
    written into ``tensor`` and returned.

    ``worker_error`` and ``server_error`` hold the error feedback between calls (`error_buffer_sizes`
    gives their sizes; start them at zero, which is no error, and keep them, e.g. in a checkpoint,
    as they are). Each is an *error state*: the values this rank last compressed, then one scale
    per chunk of them; the error it stands for is ``value - scale`` where ``value >= 0`` and
    ``value + scale`` elsewhere. ``worker_error``: ``padded`` values (``tensor.numel()`` rounded up
    to a multiple of ``8 * world_size``: this rank's input plus its error, padded with the error
    alone) and ``world_size`` scales; ``server_error``: the ``padded / world_size`` values of the
    average of this rank's chunk (plus its error) and one scale.

    ``native``: ``None`` (default) compresses with ds-ops' kernels when ds-ops is installed and
    ``tensor`` and both error buffers are contiguous CPU float32 tensors, else with torch ops;
    ``True`` requires the kernels (an error says why they cannot be used); ``False`` always uses
    torch ops. The two give the same bytes and results, so ranks may differ in this.
    """
    _require("compressed_allreduce")
    if native not in (None, True, False):
        raise ValueError(f"compressed_allreduce: native must be None, True or False, got {native!r}")
    world = get_world_size(group)
    worker_size, server_size = error_buffer_sizes(tensor.numel(), world)
    chunk = server_size - 1
    if tensor.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"compressed_allreduce: tensor must be floating point, got {tensor.dtype}")
    if worker_error.numel() != worker_size or server_error.numel() != server_size:
        raise ValueError(f"compressed_allreduce: for {tensor.numel()} elements on {world} ranks worker_error needs "
                         f"{worker_size} and server_error {server_size} elements, got {worker_error.numel()} and "
                         f"{server_error.numel()} (see ds_comm.error_buffer_sizes)")
    kernels = _kernels_for(native, tensor, worker_error, server_error)
    if tensor.numel() == 0:
        return tensor
    frame = chunk // 8 + _SCALE_BYTES
    rank = get_rank(group)
    peers = [(rank + k) % world for k in range(1, world)]

    # worker -> server: frame i of every rank to rank i. The kernels compress the peers' frames
    # first and this rank's own while those travel (straight into its place among the received).
    # frames, received and gathered: one reused staging buffer (a fresh one would be paged in on every
    # call: 3.7 ms per 8 MiB here, a few % of the call at 64M elements)
    scratch = _staging.take(3 * world * frame, torch.uint8, tensor.device)
    frames, received, gathered = scratch[: 3 * world * frame].view(3, world, frame).unbind()
    if kernels is not None:
        for peer in peers:
            kernels.compress(tensor.view(-1), worker_error.view(-1), frames, index=peer)
    else:
        _compress_torch(tensor, worker_error, frames)
    works = _exchange("all_to_all_single", frames.numel(), [(frames[p], p) for p in peers],
                      [(received[p], p) for p in peers], group, _TAG)
    if kernels is not None:
        kernels.compress(tensor.view(-1), worker_error.view(-1), received, index=rank)
    else:
        received[rank] = frames[rank]
    for work in works:
        work.wait()

    # server: average, add its error feedback, compress again into its place in the gathered frames
    if kernels is not None:
        kernels.average(received, server_error.view(-1), gathered[rank])
    else:
        _average_torch(received, server_error, gathered[rank])

    # all-gather of the servers' frames; this rank's own chunk decompressed while the others travel,
    # each of theirs as it arrives
    works = _exchange("all_gather_bucket", gathered.numel(), [(gathered[rank], p) for p in peers],
                      [(gathered[p], p) for p in peers], group, _TAG)
    flat = tensor.view(-1) if tensor.is_contiguous() else torch.empty(tensor.numel(), dtype=tensor.dtype,
                                                                       device=tensor.device)
    for i, r in enumerate([rank, *peers]):
        if i:
            works[i - 1].wait()
        out = flat[r * chunk: (r + 1) * chunk]
        if out.numel():
            if kernels is not None:
                kernels.decompress(gathered[r: r + 1], out)
            else:
                _decompress_torch(gathered[r: r + 1], out)
    for work in works[len(peers):]:
        work.wait()
    _staging.give_back(scratch)  # every message has completed (after an error it is simply dropped)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


def error_buffer_sizes(numel: int, world_size: int) -> tuple[int, int]:
    """(worker_error, server_error) element counts for a tensor of ``numel`` elements on
    ``world_size`` ranks: ``padded + world_size`` and ``padded / world_size + 1``, where ``padded``
    is ``numel`` rounded up to a multiple of ``8 * world_size`` (the values, then the scales: see
    `compressed_allreduce`)."""
    if numel < 0 or world_size < 1:
        raise ValueError(f"error_buffer_sizes: need numel >= 0 and world_size >= 1, got {numel} and {world_size}")
    unit = 8 * world_size
    padded = (numel + unit - 1) // unit * unit
    return padded + world_size, padded // world_size + 1


# ---- the torch path -------------------------------------------------------------------------------
def _compress_rows(rows: torch.Tensor, frames: torch.Tensor, scales_out: torch.Tensor) -> None:
    """Compress each row of ``rows`` (float32 [k, chunk]) into ``frames`` (uint8 [k, chunk/8 + 4]);
    the rows' scales go to ``scales_out`` (float32 [k])."""
    k, chunk = rows.shape
    scales = (torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64) / math.sqrt(chunk)).float()
    frames[:, : chunk // 8] = pack_signs(rows).view(k, chunk // 8)
    frames[:, chunk // 8:] = scales.view(torch.uint8).view(k, _SCALE_BYTES)
    scales_out.copy_(scales)


def _to_error(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An error state's values [k, chunk] become, in place, the error they stand for: value - ±scale."""
    return values.sub_(torch.where(values >= 0, scales[:, None], -scales[:, None]))


def _frame_parts(frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sign bytes [k, chunk/8], scales [k] float32, chunk) of uint8 frames [k, chunk/8 + 4]."""
    size = frames.shape[1]
    signs = frames[:, : size - _SCALE_BYTES]
    scales = frames[:, size - _SCALE_BYTES:].reshape(-1).clone().view(torch.float32)  # clone: aligned storage
    return signs, scales, (size - _SCALE_BYTES) * 8


def _compress_torch(tensor: torch.Tensor, worker_error: torch.Tensor, frames: torch.Tensor) -> None:
    """Worker side: w = tensor + the error worker_error stands for (the padding: the error alone),
    chunk i into frame i; worker_error then holds w and the scales. A contiguous float32 buffer is
    worked in place."""
    world = frames.shape[0]
    in_place = worker_error.dtype == torch.float32 and worker_error.is_contiguous()
    work = worker_error.view(-1) if in_place else worker_error.reshape(-1).to(torch.float32, copy=True)
    values, scales = work[:-world].view(world, -1), work[-world:]
    _to_error(values, scales)
    x = tensor.reshape(-1)
    # float16/bfloat16 widen exactly inside the add; float64 is rounded to float32 first
    values.view(-1)[: x.numel()] += x.float() if x.dtype == torch.float64 else x
    _compress_rows(values, frames, scales)
    if not in_place:
        worker_error.copy_(work.view(worker_error.shape))


def _average_torch(received: torch.Tensor, server_error: torch.Tensor, out: torch.Tensor) -> None:
    """Server side: the mean of the received frames, (±s_0 + ±s_1 + ...) / world in rank order,
    plus the error server_error stands for, compressed into ``out``; server_error then holds that
    mean and its scale. A contiguous float32 buffer is worked in place."""
    signs, scales, chunk = _frame_parts(received)
    average = unpack_signs(signs[0]) * scales[0]
    for r in range(1, received.shape[0]):
        average += unpack_signs(signs[r]) * scales[r]
    average /= received.shape[0]
    in_place = server_error.dtype == torch.float32 and server_error.is_contiguous()
    state = server_error.view(-1) if in_place else server_error.reshape(-1).to(torch.float32, copy=True)
    average += _to_error(state[:chunk].view(1, chunk), state[chunk:]).view(-1)
    state[:chunk] = average
    _compress_rows(state[:chunk].view(1, chunk), out.view(1, -1), state[chunk:])
    if not in_place:
        server_error.copy_(state.view(server_error.shape))


def _decompress_torch(frames: torch.Tensor, out: torch.Tensor) -> None:
    """±scale of the frames' elements, in order, into ``out`` (flat; the padding past its end dropped)."""
    signs, scales, chunk = _frame_parts(frames)
    bits = ((signs.reshape(-1, 1) >> _SHIFTS.to(signs.device)) & 1).view(frames.shape[0], chunk).bool()
    values = torch.where(bits, scales[:, None], -scales[:, None])
    out.copy_(values.view(-1)[: out.numel()].view(out.shape))


# ---- the native path ------------------------------------------------------------------------------
_UNSET = object()
_native: object = _UNSET  # ds_ops.onebit once loaded, None when it cannot be
_native_problem = ""


def _native_kernels() -> ModuleType | None:
    """ds-ops' onebit kernels, built on first use; None (and why, in ``_native_problem``) when
    ds-ops is not installed or the op cannot be built. Decided once per process."""
    global _native, _native_problem
    if _native is _UNSET:
        try:
            import ds_ops
        except ImportError as e:
            _native, _native_problem = None, f"ds-ops is not installed ({e}); pip install ds-comm[ops]"
            logger.debug("compressed_allreduce: %s; compressing with torch ops", _native_problem)
            return None
        try:
            from ds_ops import OpBuildError, onebit
        except ImportError as e:
            _native, _native_problem = None, (f"ds-ops {getattr(ds_ops, '__version__', '')} has no onebit kernels "
                                              f"({e}); upgrade ds-ops")
            logger.warning("ds_comm.compressed_allreduce: %s; compressing with torch ops instead", _native_problem)
            return None
        try:
            onebit.load()
        except (OpBuildError, ImportError, OSError) as e:
            _native, _native_problem = None, f"ds-ops' onebit op cannot be built or loaded: {e}"
            logger.warning("ds_comm.compressed_allreduce: %s; compressing with torch ops instead", _native_problem)
            return None
        _native = onebit
    return _native


def _kernels_for(native: bool | None, tensor: torch.Tensor, worker_error: torch.Tensor,
                 server_error: torch.Tensor) -> ModuleType | None:
    """The kernels this call uses, or None for the torch path (see `compressed_allreduce`)."""
    if native is False:
        return None
    for name, t in (("tensor", tensor), ("worker_error", worker_error), ("server_error", server_error)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            if native:
                raise ValueError(f"compressed_allreduce(native=True): {name} must be a contiguous CPU float32 tensor "
                                 f"for ds-ops' kernels, got {t.dtype} on {t.device}"
                                 f"{'' if t.is_contiguous() else ', not contiguous'} (native=None falls back to "
                                 "torch ops)")
            return None
    kernels = _native_kernels()
    if kernels is None and native:
        raise RuntimeError(f"compressed_allreduce(native=True): {_native_problem}")
    return kernels
