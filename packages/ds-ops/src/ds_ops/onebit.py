"""1-bit compression with error feedback (1-bit Adam, Tang et al. 2021) on CPU float32 buffers:
the kernels behind ``ds_comm.compressed_allreduce`` (op ``onebit``, built on first use).

A *frame* is one chunk of ``chunk`` values compressed: their signs (bit 1 for >= 0, 8 per byte,
least significant bit first: element ``8j+i`` is bit ``i`` of byte ``j``, as ``ds_comm.pack_signs``)
followed by the chunk's scale, its root mean square, as a float32 in native byte order:
``frame_bytes(chunk) = chunk / 8 + 4`` bytes. Decompressed, an element is +scale or -scale.

The error feedback lives in an *error state*, a float32 buffer kept between calls: the values last
compressed (``w``, the input plus the error before it), then one scale per chunk of them
(`state_size`). The error it stands for, ``w - ±scale`` (``+scale`` where ``w >= 0``), is
recomputed as the next call reads the state, so each kernel is one pass over memory: the error
itself is never written. A zero state is no error.

    frames = torch.empty(world, onebit.frame_bytes(chunk), dtype=torch.uint8)
    onebit.compress(grad, worker_state, frames)       # worker: w = grad + error -> frames; the state keeps w
    onebit.average(received, server_state, mine)      # server: mean of the world frames + its error -> a frame
    onebit.decompress(gathered, grad)                 # ±scale of every element into grad

Each kernel is vectorised, runs on ``torch.get_num_threads()`` threads unless ``num_threads`` says
otherwise, with the GIL released. Every buffer is a contiguous CPU tensor; a bad one raises
``ValueError`` naming it.
"""

from __future__ import annotations

from types import ModuleType

import torch

from .op_builder import OneBitBuilder

__all__ = ["SCALE_BYTES", "average", "compress", "decompress", "frame_bytes", "load", "state_size"]

SCALE_BYTES = 4


def frame_bytes(chunk: int) -> int:
    """Bytes of the frame of a chunk of ``chunk`` values (a multiple of 8): signs, then the scale."""
    if chunk < 8 or chunk % 8:
        raise ValueError(f"ds_ops.onebit: a chunk must hold a positive multiple of 8 values, got {chunk}")
    return chunk // 8 + SCALE_BYTES


def state_size(chunks: int, chunk: int) -> int:
    """Elements of the error state of ``chunks`` chunks of ``chunk`` values: the values, then a scale per chunk."""
    frame_bytes(chunk)  # checks chunk
    if chunks < 1:
        raise ValueError(f"ds_ops.onebit: need at least one chunk, got {chunks}")
    return chunks * chunk + chunks


def load() -> ModuleType:
    """The built op (compiled on first use); raises `ds_ops.OpBuildError` when it cannot be built."""
    return OneBitBuilder().load()


def compress(tensor: torch.Tensor, error: torch.Tensor, frames: torch.Tensor, num_threads: int | None = None,
             *, index: int | None = None) -> torch.Tensor:
    """Worker side: ``w = tensor + e`` where ``e`` is the error that the error state ``error``
    stands for (``tensor`` counts as 0 past its end: ``w`` has ``chunks * chunk`` elements, the
    padding the error alone), chunk ``c`` of ``w`` compressed into ``frames[c]``; ``error`` then
    holds ``w`` and the new scales (``state_size(chunks, chunk)`` elements). ``frames``: uint8
    ``[chunks, frame_bytes(chunk)]``. ``index``: only chunk ``index`` is compressed (into
    ``frames[index]``; its part of the state alone is read and written), so that a frame can be
    sent while the next is compressed. Returns ``frames``."""
    _check_float32("compress", "tensor", tensor)
    _check_float32("compress", "error", error)
    chunks, chunk = _check_frames("compress", "frames", frames)
    if error.numel() != state_size(chunks, chunk) or tensor.numel() > chunks * chunk:
        raise ValueError(f"ds_ops.onebit.compress: frames {tuple(frames.shape)} hold {chunks} chunks of {chunk} "
                         f"values, so error must have {state_size(chunks, chunk)} elements (the values and a scale "
                         f"per chunk) and tensor at most {chunks * chunk}; got error {error.numel()}, tensor "
                         f"{tensor.numel()}")
    values, scales, x, n, out = (error.data_ptr(), error.data_ptr() + 4 * chunks * chunk, tensor.data_ptr(),
                                 tensor.numel(), frames.data_ptr())
    if index is not None:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < chunks:
            raise ValueError(f"ds_ops.onebit.compress: index must be a chunk index in [0, {chunks}), got {index!r}")
        start = index * chunk
        values, scales, x, out = values + 4 * start, scales + 4 * index, x + 4 * start, out + index * frames.shape[1]
        n, chunks = min(max(n - start, 0), chunk), 1
    load().compress(x, n, values, scales, chunks, chunk, out, _threads(num_threads))
    return frames


def average(frames: torch.Tensor, server_error: torch.Tensor, out: torch.Tensor,
            num_threads: int | None = None) -> torch.Tensor:
    """Server side: the frames of one chunk from every rank (uint8 ``[world, frame_bytes(chunk)]``)
    decompressed and averaged, ``a = (±s_0 + ±s_1 + ...) / world + e`` (added in rank order) where
    ``e`` is the error the error state ``server_error`` (``state_size(1, chunk)`` elements) stands
    for, compressed into ``out`` (uint8, ``frame_bytes(chunk)``); ``server_error`` then holds ``a``
    and its scale. Returns ``out``."""
    world, chunk = _check_frames("average", "frames", frames)
    _check_float32("average", "server_error", server_error)
    _check_bytes("average", "out", out)
    if server_error.numel() != state_size(1, chunk) or out.numel() != frame_bytes(chunk):
        raise ValueError(f"ds_ops.onebit.average: frames {tuple(frames.shape)} hold chunks of {chunk} values, so "
                         f"server_error must have {state_size(1, chunk)} elements and out {frame_bytes(chunk)} "
                         f"bytes; got {server_error.numel()} and {out.numel()}")
    values = server_error.data_ptr()
    load().average(frames.data_ptr(), world, chunk, values, values + 4 * chunk, out.data_ptr(), _threads(num_threads))
    return out


def decompress(frames: torch.Tensor, out: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """``out`` (float32, at most ``chunks * chunk`` elements) receives ±scale of each element of the
    frames (uint8 ``[chunks, frame_bytes(chunk)]``), in order; the padding past ``out``'s end is
    skipped. Returns ``out``."""
    chunks, chunk = _check_frames("decompress", "frames", frames)
    _check_float32("decompress", "out", out)
    if out.numel() > chunks * chunk:
        raise ValueError(f"ds_ops.onebit.decompress: frames {tuple(frames.shape)} hold {chunks * chunk} values, "
                         f"out has {out.numel()} elements")
    load().decompress(frames.data_ptr(), chunks, chunk, out.data_ptr(), out.numel(), _threads(num_threads))
    return out


# ---- checks ---------------------------------------------------------------------------------------
def _where(tensor: torch.Tensor) -> str:
    return f"{tensor.dtype} on {tensor.device}{'' if tensor.is_contiguous() else ', not contiguous'}"


def _check_float32(call: str, name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"ds_ops.onebit.{call}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"ds_ops.onebit.{call}: {name} must be a contiguous CPU float32 tensor, got "
                         f"{_where(tensor)}")


def _check_bytes(call: str, name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"ds_ops.onebit.{call}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.uint8 or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"ds_ops.onebit.{call}: {name} must be a contiguous CPU uint8 tensor, got {_where(tensor)}")


def _check_frames(call: str, name: str, frames: torch.Tensor) -> tuple[int, int]:
    """(frames, values per chunk) of a uint8 [frames, chunk / 8 + 4] tensor."""
    _check_bytes(call, name, frames)
    if frames.dim() != 2 or frames.shape[0] < 1 or frames.shape[1] <= SCALE_BYTES:
        raise ValueError(f"ds_ops.onebit.{call}: {name} must be [frames, chunk / 8 + {SCALE_BYTES}] bytes with at "
                         f"least one frame and one byte of signs, got shape {tuple(frames.shape)}")
    return frames.shape[0], (frames.shape[1] - SCALE_BYTES) * 8


def _threads(num_threads: int | None) -> int:
    if num_threads is None:
        return torch.get_num_threads()
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"ds_ops.onebit: num_threads must be a positive integer, got {num_threads!r}")
    return num_threads
