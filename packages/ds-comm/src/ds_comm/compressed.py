"""1-bit compressed all-reduce with error feedback (1-bit Adam, Tang et al. 2021).

Each rank ("worker") adds its error feedback, splits the tensor into one chunk per rank, and
compresses every chunk to sign bits (8 per byte) plus one scale (the chunk's RMS). An all-to-all
hands chunk i to rank i (the "server" of that chunk), which averages the decompressed chunks,
adds its own error feedback, and compresses the average again; an all-gather returns every
server's compressed chunk to everyone. The errors of both compressions are kept and added back
next time, so repeated calls average out to the exact mean. On the wire: about 1/32 of an fp32
all-reduce, plus a few scales.

A compressed chunk travels as one *frame*: its sign bits (`pack_signs`' layout) followed by its
scale as a float32 (native byte order), ``chunk / 8 + 4`` bytes, so each step is one collective.

Two implementations produce the same frames and results: ds-ops' ``onebit`` kernels (one or two
passes over memory each, threaded, vectorised; used when ds-ops is installed, ``pip install
ds-comm[ops]``, and the tensors are contiguous CPU float32) and torch ops (any device and float
dtype; what runs with ds-comm alone). Both sum a chunk's squares in float64 and do every float32
operation in the same order; only that sum's order differs, so a scale could differ in its last
bit in rare cases (the tests find them identical).
"""

from __future__ import annotations

import logging
import math
from types import ModuleType

import torch

from .collectives import all_gather_bucket, all_to_all_single
from .distributed import _require, get_rank, get_world_size

logger = logging.getLogger(__name__)

_SHIFTS = torch.arange(8, dtype=torch.uint8)
_SCALE_BYTES = 4  # a frame's scale: one float32 after the sign bytes
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


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

    ``worker_error`` holds ``padded`` elements and ``server_error`` ``padded / world_size``, where
    ``padded`` is ``tensor.numel()`` rounded up to a multiple of ``8 * world_size``
    (`error_buffer_sizes` computes both); start them at zero and keep them between calls.

    ``native``: ``None`` (default) compresses with ds-ops' kernels when ds-ops is installed and
    ``tensor`` and both error buffers are contiguous CPU float32 tensors, else with torch ops;
    ``True`` requires the kernels (an error says why they cannot be used); ``False`` always uses
    torch ops. The two give the same bytes and results, so ranks may differ in this.
    """
    _require("compressed_allreduce")
    if native not in (None, True, False):
        raise ValueError(f"compressed_allreduce: native must be None, True or False, got {native!r}")
    world = get_world_size(group)
    padded, chunk = error_buffer_sizes(tensor.numel(), world)
    if tensor.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"compressed_allreduce: tensor must be floating point, got {tensor.dtype}")
    if worker_error.numel() != padded or server_error.numel() != chunk:
        raise ValueError(f"compressed_allreduce: for {tensor.numel()} elements on {world} ranks worker_error needs "
                         f"{padded} and server_error {chunk} elements, got {worker_error.numel()} and "
                         f"{server_error.numel()} (see ds_comm.compressed.error_buffer_sizes)")
    kernels = _kernels_for(native, tensor, worker_error, server_error)
    if tensor.numel() == 0:
        return tensor
    frame = chunk // 8 + _SCALE_BYTES
    frames = torch.empty(world, frame, dtype=torch.uint8, device=tensor.device)
    if kernels is not None:
        kernels.compress(tensor.view(-1), worker_error.view(-1), frames)
    else:
        _compress_torch(tensor, worker_error, frames)

    # worker -> server: frame i of every rank to rank i
    received = torch.empty_like(frames)
    all_to_all_single(received, frames, group=group)

    # server: average, add its error feedback, compress again straight into its place in the
    # gather buffer; the all-gather then runs in place
    gathered = torch.empty(world * frame, dtype=torch.uint8, device=tensor.device)
    mine = gathered.view(world, frame)[get_rank(group)]
    if kernels is not None:
        kernels.average(received, server_error.view(-1), mine)
    else:
        _average_torch(received, server_error, mine)
    all_gather_bucket(gathered, group=group)

    if kernels is not None:
        kernels.decompress(gathered.view(world, frame), tensor.view(-1))
    else:
        _decompress_torch(gathered.view(world, frame), tensor)
    return tensor


def error_buffer_sizes(numel: int, world_size: int) -> tuple[int, int]:
    """(worker_error, server_error) element counts for a tensor of ``numel`` elements."""
    unit = 8 * world_size
    padded = (numel + unit - 1) // unit * unit
    return padded, padded // world_size


# ---- the torch path -------------------------------------------------------------------------------
def _compress_rows(rows: torch.Tensor, frames: torch.Tensor) -> None:
    """Compress each row of ``rows`` (float32 [k, chunk]) into ``frames`` (uint8 [k, chunk/8 + 4]);
    ``rows`` becomes the compression error, row - ±scale."""
    k, chunk = rows.shape
    scales = (torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64) / math.sqrt(chunk)).float()
    frames[:, : chunk // 8] = pack_signs(rows).view(k, chunk // 8)
    frames[:, chunk // 8:] = scales.view(torch.uint8).view(k, _SCALE_BYTES)
    rows -= torch.where(rows >= 0, scales[:, None], -scales[:, None])


def _frame_parts(frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sign bytes [k, chunk/8], scales [k] float32, chunk) of uint8 frames [k, chunk/8 + 4]."""
    size = frames.shape[1]
    signs = frames[:, : size - _SCALE_BYTES]
    scales = frames[:, size - _SCALE_BYTES:].reshape(-1).clone().view(torch.float32)  # clone: aligned storage
    return signs, scales, (size - _SCALE_BYTES) * 8


def _compress_torch(tensor: torch.Tensor, worker_error: torch.Tensor, frames: torch.Tensor) -> None:
    """Worker side: w = tensor + worker_error (the padding: the error alone), chunk i into frame i;
    worker_error becomes w - ±scale. A contiguous float32 error buffer is worked in place."""
    world = frames.shape[0]
    in_place = worker_error.dtype == torch.float32 and worker_error.is_contiguous()
    work = worker_error.view(-1) if in_place else worker_error.reshape(-1).to(torch.float32, copy=True)
    x = tensor.reshape(-1)
    # float16/bfloat16 widen exactly inside the add; float64 is rounded to float32 first
    work[: x.numel()] += x.float() if x.dtype == torch.float64 else x
    _compress_rows(work.view(world, -1), frames)
    if not in_place:
        worker_error.copy_(work.view(worker_error.shape))


def _average_torch(received: torch.Tensor, server_error: torch.Tensor, out: torch.Tensor) -> None:
    """Server side: the mean of the received frames, (±s_0 + ±s_1 + ...) / world in rank order,
    plus server_error, compressed into ``out``; server_error becomes that value - ±scale."""
    signs, scales, chunk = _frame_parts(received)
    average = unpack_signs(signs[0]) * scales[0]
    for r in range(1, received.shape[0]):
        average += unpack_signs(signs[r]) * scales[r]
    average /= received.shape[0]
    average += server_error.reshape(-1)
    _compress_rows(average.view(1, chunk), out.view(1, -1))
    server_error.copy_(average.view(server_error.shape))


def _decompress_torch(gathered: torch.Tensor, tensor: torch.Tensor) -> None:
    """±scale of every element of the gathered frames into ``tensor`` (the padding dropped)."""
    signs, scales, chunk = _frame_parts(gathered)
    bits = ((signs.reshape(-1, 1) >> _SHIFTS.to(signs.device)) & 1).view(gathered.shape[0], chunk).bool()
    values = torch.where(bits, scales[:, None], -scales[:, None])
    tensor.copy_(values.view(-1)[: tensor.numel()].view(tensor.shape))


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
