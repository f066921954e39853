"""Block quantization in torch ops: the device path of `ds_ops.quantize` (any device torch runs on,
CUDA included) and the oracle the CPU kernels are tested against, bit for bit.

The float32 operations are the kernels' own, in the same order: ``scale = absmax / qmax``,
``q = clamp(round(x / scale), -qmax, qmax)`` (``torch.round``: half to even), ``x' = float(q) *
scale``, sums in tensor order. A group with inf or nan: scale nan, q 0; a group whose scale is 0: q 0.
"""

from __future__ import annotations

import torch

QMAX = {8: 127.0, 4: 7.0}


def num_groups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x (flat) as float32 [groups, group_size], zero-padded at the end."""
    flat = x.reshape(-1).float()
    pad = num_groups(flat.numel(), group_size) * group_size - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, group_size)


def quantize(x: torch.Tensor, group_size: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): q int8 [numel] for 8 bits, uint8 [ceil(numel / 2)] (two per byte) for 4."""
    n, qmax = x.numel(), QMAX[bits]
    groups = _grouped(x, group_size)
    absmax = groups.abs().amax(dim=1) if groups.numel() else groups.new_zeros(groups.shape[0])
    scales = torch.where(torch.isfinite(absmax), absmax / qmax, torch.full_like(absmax, float("nan")))
    live = (scales > 0)[:, None]
    ratio = torch.where(live, groups / torch.where(live, scales[:, None], 1.0), 0.0)
    q = torch.clamp(torch.round(ratio), -qmax, qmax).to(torch.int8).view(-1)[:n]
    return (q if bits == 8 else pack_int4(q)), scales


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7] -> bytes, element 2j in the high nibble, 2j+1 in the low one."""
    if q.numel() % 2:
        q = torch.cat([q, q.new_zeros(1)])
    pairs = q.view(-1, 2).to(torch.int16) & 0xF
    return ((pairs[:, 0] << 4) | pairs[:, 1]).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The int8 values of `pack_int4`'s bytes (the first ``numel``)."""
    b = packed.view(torch.int8).to(torch.int16)
    high = b >> 4  # arithmetic: the signed high nibble
    low = ((b & 0xF) ^ 8) - 8  # the low nibble, sign-extended
    return torch.stack([high, low], dim=1).view(-1)[:numel].to(torch.int8)


def _values(q: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """The quantized values as float32 (flat, ``numel``)."""
    return (q.view(torch.int8)[:numel] if bits == 8 else unpack_int4(q, numel)).float()


def _dequantize_float(q: torch.Tensor, scales: torch.Tensor, numel: int, group_size: int, bits: int) -> torch.Tensor:
    values = _values(q.reshape(-1), numel, bits)
    return values * scales.reshape(-1).repeat_interleave(group_size)[:numel]


def dequantize(q: torch.Tensor, scales: torch.Tensor, numel: int, group_size: int, bits: int,
               dtype: torch.dtype) -> torch.Tensor:
    return _dequantize_float(q, scales, numel, group_size, bits).to(dtype)


def dequantize_sum(q: torch.Tensor, scales: torch.Tensor, numel: int, group_size: int, bits: int) -> torch.Tensor:
    """The float32 sum, in order, of the k dequantized tensors of q [k, bytes] and scales [k, groups]."""
    total = None
    for t in range(q.shape[0]):
        x = _dequantize_float(q[t], scales[t], numel, group_size, bits)
        total = x if total is None else total + x
    return total
