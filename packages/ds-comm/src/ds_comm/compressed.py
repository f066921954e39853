"""1-bit compressed all-reduce with error feedback (1-bit Adam, Tang et al. 2021).

Each rank ("worker") adds its error feedback, splits the tensor into one chunk per rank, and
compresses every chunk to sign bits (8 per byte) plus one scale (the chunk's RMS). An all-to-all
hands chunk i to rank i (the "server" of that chunk), which averages the decompressed chunks,
adds its own error feedback, and compresses the average again; an all-gather returns every
server's compressed chunk to everyone. The errors of both compressions are kept and added back
next time, so repeated calls average out to the exact mean. On the wire: about 1/32 of an fp32
all-reduce, plus a few scales.
"""

from __future__ import annotations

import torch

from .collectives import all_gather_into_tensor, all_to_all_single
from .distributed import _require, get_world_size

_SHIFTS = torch.arange(8, dtype=torch.uint8)


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


def _compress(chunks: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed signs, per-chunk scales) of ``chunks`` [k, n]; the compression error goes to ``error``."""
    scales = chunks.norm(dim=1) / chunks.shape[1] ** 0.5
    signs = torch.where(chunks >= 0, 1.0, -1.0).to(chunks.dtype)
    error.copy_((chunks - scales[:, None] * signs).reshape(error.shape))
    return pack_signs(chunks), scales


def compressed_allreduce(tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                         group=None) -> torch.Tensor:
    """Average ``tensor`` over the ranks with 1-bit compression and error feedback; the result is
    written into ``tensor`` and returned.

    ``worker_error`` holds ``padded`` elements and ``server_error`` ``padded / world_size``, where
    ``padded`` is ``tensor.numel()`` rounded up to a multiple of ``8 * world_size``
    (`error_buffer_sizes` computes both); start them at zero and keep them between calls.
    """
    _require("compressed_allreduce")
    world = get_world_size(group)
    padded, chunk = error_buffer_sizes(tensor.numel(), world)
    if tensor.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise TypeError(f"compressed_allreduce: tensor must be floating point, got {tensor.dtype}")
    if worker_error.numel() != padded or server_error.numel() != chunk:
        raise ValueError(f"compressed_allreduce: for {tensor.numel()} elements on {world} ranks worker_error needs "
                         f"{padded} and server_error {chunk} elements, got {worker_error.numel()} and "
                         f"{server_error.numel()} (see ds_comm.compressed.error_buffer_sizes)")
    work = torch.zeros(padded, dtype=torch.float32, device=tensor.device)
    work[: tensor.numel()] = tensor.reshape(-1).float()
    work += worker_error.reshape(-1).float()
    werr = torch.empty(padded, dtype=torch.float32, device=tensor.device)
    packed, scales = _compress(work.view(world, chunk), werr)
    worker_error.copy_(werr.reshape(worker_error.shape))

    # worker -> server: chunk i of every rank to rank i, with its scale
    received = torch.empty_like(packed)
    all_to_all_single(received, packed, group=group)
    received_scales = torch.empty_like(scales)
    all_to_all_single(received_scales, scales, group=group)
    average = (unpack_signs(received).view(world, chunk) * received_scales[:, None]).mean(dim=0)

    # server: add its error feedback, compress again, send to everyone
    average += server_error.reshape(-1).float()
    serr = torch.empty(chunk, dtype=torch.float32, device=tensor.device)
    server_packed, server_scale = _compress(average.view(1, chunk), serr)
    server_error.copy_(serr.reshape(server_error.shape))
    gathered = torch.empty(server_packed.numel() * world, dtype=torch.uint8, device=tensor.device)
    all_gather_into_tensor(gathered, server_packed, group=group)
    gathered_scales = torch.empty(world, dtype=server_scale.dtype, device=tensor.device)
    all_gather_into_tensor(gathered_scales, server_scale, group=group)
    result = unpack_signs(gathered).view(world, chunk) * gathered_scales[:, None]
    tensor.copy_(result.reshape(-1)[: tensor.numel()].view(tensor.shape).to(tensor.dtype))
    return tensor


def error_buffer_sizes(numel: int, world_size: int) -> tuple[int, int]:
    """(worker_error, server_error) element counts for a tensor of ``numel`` elements."""
    unit = 8 * world_size
    padded = (numel + unit - 1) // unit * unit
    return padded, padded // world_size
