"""Block quantization for ZeRO++ (qwZ: int8 parameter all-gathers; qgZ: int4/int8 gradient
reductions): symmetric, one float32 scale per block ("group") of ``group_size`` consecutive
elements of the flattened tensor (the last group may be shorter).

    q, scales = ds_ops.quantize_blockwise(x, group_size=2048, bits=8)      # int8 [numel], float32 [groups]
    y = ds_ops.dequantize_blockwise(q, scales, x.numel(), group_size=2048, bits=8, dtype=x.dtype)
    total = ds_ops.dequantize_sum_blockwise(qs, scales_k, numel, 2048, bits=4)     # k tensors summed
    q2, s2 = ds_ops.requantize_sum_blockwise(qs, scales_k, numel, 2048, bits=4)   # ... and requantized

The contract, the same on every path (CPU kernels at every SIMD level, torch ops on a device):

* ``scale = absmax / qmax`` (float32; ``qmax`` = 127 for int8, 7 for int4), ``q = clamp(round(x /
  scale), -qmax, qmax)`` with round half to even, ``x' = float(q) * scale`` (float32, then rounded
  to nearest-even into the output dtype). So ``|x - x'| <= scale / 2`` up to float32 rounding
  (``2^-24`` relative): see the README's "Quantization" section for the exact bound.
* A group holding inf or nan gets scale nan and q 0: it dequantizes to nan (an overflow stays
  visible to a loss scaler after the collective). A group of zeros (or whose absmax is below
  ``127 * 2^-150``, where the scale underflows) gets scale 0 and q 0: no division by zero.
* Subnormals are kept (inputs and scales), whatever the thread's flush-to-zero mode.
* int8: ``torch.int8``, one per element. int4: ``torch.uint8``, two per byte, element ``2j`` in the
  high nibble and ``2j + 1`` in the low one (DeepSpeed's order); ``group_size`` must be even.
* Sums (``*_sum_blockwise``) dequantize each of the k tensors and add them in float32 in order:
  ``((x'_0 + x'_1) + x'_2) ...``.

CPU tensors run the ``quantize`` op (built on first use; vectorised, threaded over whole groups, so
the bytes do not depend on the thread count); tensors on another device run the same arithmetic in
torch ops there (``native=False`` picks that path on the CPU too). The two give the same bytes.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import _quantize_torch as _ref
from .op_builder import QuantizeBuilder

__all__ = ["dequantize_blockwise", "dequantize_sum_blockwise", "load", "num_groups", "quantize_blockwise",
           "quantized_bytes", "requantize_sum_blockwise"]

_BITS = (8, 4)
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def load() -> ModuleType:
    """The built op (compiled on first use); raises `ds_ops.OpBuildError` when it cannot be built."""
    return QuantizeBuilder().load()


def num_groups(numel: int, group_size: int) -> int:
    """Groups (and scales) of a tensor of ``numel`` elements: ``ceil(numel / group_size)``."""
    _check_layout("num_groups", numel, group_size, 8)
    return _ref.num_groups(numel, group_size)


def quantized_bytes(numel: int, bits: int) -> int:
    """Bytes of the quantized values of ``numel`` elements: ``numel`` (int8) or ``ceil(numel / 2)`` (int4)."""
    _check_bits("quantized_bytes", bits)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"ds_ops.quantized_bytes: numel must be a non-negative integer, got {numel!r}")
    return numel if bits == 8 else (numel + 1) // 2


def quantize_blockwise(x: torch.Tensor, group_size: int, bits: int = 8, *, num_threads: int | None = None,
                       native: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32, float16 or bfloat16, any shape; read flat) -> ``(q, scales)``: ``q`` int8
    ``[numel]`` (8 bits) or uint8 ``[ceil(numel / 2)]`` (4 bits), ``scales`` float32 ``[groups]``, on
    ``x``'s device. ``native``: None (default) runs the CPU kernel for CPU tensors and torch ops
    elsewhere; False: torch ops everywhere; True: the kernel (CPU tensors only)."""
    _check_float("quantize_blockwise", "x", x)
    _check_layout("quantize_blockwise", x.numel(), group_size, bits)
    n = x.numel()
    if not _use_kernel("quantize_blockwise", native, x):
        return _ref.quantize(x, group_size, bits)
    x = x.contiguous()
    q = torch.empty(quantized_bytes(n, bits), dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.empty(_ref.num_groups(n, group_size), dtype=torch.float32)
    if n:
        load().quantize(x.data_ptr(), _DTYPE_CODES[x.dtype], n, group_size, bits, q.data_ptr(), scales.data_ptr(),
                        _threads(num_threads))
    return q, scales


def dequantize_blockwise(q: torch.Tensor, scales: torch.Tensor, numel: int, group_size: int, bits: int = 8,
                         dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None,
                         num_threads: int | None = None, native: bool | None = None) -> torch.Tensor:
    """The ``numel`` values of `quantize_blockwise`'s ``(q, scales)``, flat, in ``dtype`` (float32,
    float16 or bfloat16), or written into ``out`` (contiguous, ``numel`` elements, whose dtype wins)."""
    _check_layout("dequantize_blockwise", numel, group_size, bits)
    _check_quantized("dequantize_blockwise", q, scales, 1, numel, group_size, bits)
    if out is not None:
        _check_out("dequantize_blockwise", out, numel, q.device)
        dtype = out.dtype
    _check_dtype("dequantize_blockwise", dtype)
    if not _use_kernel("dequantize_blockwise", native, q, scales):
        result = _ref.dequantize(q, scales, numel, group_size, bits, dtype)
        return result if out is None else out.view(-1).copy_(result).view(out.shape)
    target = torch.empty(numel, dtype=dtype) if out is None else out
    if numel:
        load().dequantize(q.contiguous().data_ptr(), scales.contiguous().data_ptr(), numel, group_size, bits,
                          target.data_ptr(), _DTYPE_CODES[dtype], _threads(num_threads))
    return target


def dequantize_sum_blockwise(q: torch.Tensor, scales: torch.Tensor, numel: int, group_size: int, bits: int = 8,
                             dtype: torch.dtype = torch.float32, *, num_threads: int | None = None,
                             native: bool | None = None) -> torch.Tensor:
    """The sum of k quantized tensors (``q``: ``[k, quantized_bytes(numel, bits)]``, ``scales``:
    ``[k, groups]``, e.g. what an all-to-all received from k ranks), dequantized and added in
    float32 in order, flat, in ``dtype``."""
    k = _check_stack("dequantize_sum_blockwise", q, scales, numel, group_size, bits)
    _check_dtype("dequantize_sum_blockwise", dtype)
    if not _use_kernel("dequantize_sum_blockwise", native, q, scales):
        return _ref.dequantize_sum(q, scales, numel, group_size, bits).to(dtype)
    out = torch.empty(numel, dtype=dtype)
    if numel:
        load().dequantize_sum(q.contiguous().data_ptr(), scales.contiguous().data_ptr(), k, numel, group_size, bits,
                              0, 0, 8, out.data_ptr(), _DTYPE_CODES[dtype], _threads(num_threads))
    return out


def requantize_sum_blockwise(q: torch.Tensor, scales: torch.Tensor, numel: int, group_size: int, bits: int = 8,
                             out_bits: int | None = None, *, num_threads: int | None = None,
                             native: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`dequantize_sum_blockwise`'s float32 sum quantized again (``out_bits``, default ``bits``, the
    same groups) in one pass: qgZ's reduction between its two all-to-alls. Returns ``(q, scales)``
    as `quantize_blockwise` would for that sum."""
    k = _check_stack("requantize_sum_blockwise", q, scales, numel, group_size, bits)
    out_bits = bits if out_bits is None else out_bits
    _check_layout("requantize_sum_blockwise", numel, group_size, out_bits)
    if not _use_kernel("requantize_sum_blockwise", native, q, scales):
        return _ref.quantize(_ref.dequantize_sum(q, scales, numel, group_size, bits), group_size, out_bits)
    out_q = torch.empty(quantized_bytes(numel, out_bits), dtype=torch.int8 if out_bits == 8 else torch.uint8)
    out_scales = torch.empty(_ref.num_groups(numel, group_size), dtype=torch.float32)
    if numel:
        load().dequantize_sum(q.contiguous().data_ptr(), scales.contiguous().data_ptr(), k, numel, group_size, bits,
                              out_q.data_ptr(), out_scales.data_ptr(), out_bits, 0, 0, _threads(num_threads))
    return out_q, out_scales


# ---- checks -----------------------------------------------------------------------------------------
def _use_kernel(call: str, native: bool | None, *tensors: torch.Tensor) -> bool:
    if not (native is None or native is True or native is False):
        raise ValueError(f"ds_ops.{call}: native must be None, True or False, got {native!r}")
    on_cpu = all(t.device.type == "cpu" for t in tensors)
    if native and not on_cpu:
        raise ValueError(f"ds_ops.{call}: native=True needs CPU tensors, got tensors on "
                         f"{sorted({str(t.device) for t in tensors})}")
    return on_cpu and native is not False


def _check_bits(call: str, bits) -> None:
    if isinstance(bits, bool) or bits not in _BITS:
        raise ValueError(f"ds_ops.{call}: bits must be 8 or 4, got {bits!r}")


def _check_layout(call: str, numel, group_size, bits) -> None:
    _check_bits(call, bits)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"ds_ops.{call}: numel must be a non-negative integer, got {numel!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or (
            bits == 4 and group_size % 2):
        raise ValueError(f"ds_ops.{call}: group_size must be a positive integer{', even for int4' if bits == 4 else ''}"
                         f", got {group_size!r}")


def _check_float(call: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"ds_ops.{call}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPE_CODES:
        raise ValueError(f"ds_ops.{call}: {name} must be float32, float16 or bfloat16, got {t.dtype}")


def _check_dtype(call: str, dtype) -> None:
    if dtype not in _DTYPE_CODES:
        raise ValueError(f"ds_ops.{call}: dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}")


def _check_quantized(call: str, q, scales, k: int, numel: int, group_size: int, bits: int) -> None:
    for name, t in (("q", q), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"ds_ops.{call}: {name} must be a torch.Tensor, got {type(t).__name__}")
    wanted = (torch.int8, torch.uint8) if bits == 8 else (torch.uint8,)
    if q.dtype not in wanted:
        raise ValueError(f"ds_ops.{call}: q of {bits}-bit values must be {' or '.join(map(str, wanted))}, got {q.dtype}")
    if scales.dtype != torch.float32:
        raise ValueError(f"ds_ops.{call}: scales must be float32, got {scales.dtype}")
    if q.device != scales.device:
        raise ValueError(f"ds_ops.{call}: q and scales must be on one device, got {q.device} and {scales.device}")
    need_q, need_s = k * quantized_bytes(numel, bits), k * _ref.num_groups(numel, group_size)
    if q.numel() != need_q or scales.numel() != need_s:
        raise ValueError(f"ds_ops.{call}: {k} tensor(s) of {numel} elements in groups of {group_size} at {bits} bits "
                         f"need q of {need_q} bytes and {need_s} scales, got {q.numel()} and {scales.numel()}")


def _check_stack(call: str, q, scales, numel, group_size, bits) -> int:
    _check_layout(call, numel, group_size, bits)
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.shape[0] < 1:
        raise ValueError(f"ds_ops.{call}: q must be a [k, bytes] tensor with k >= 1, got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    _check_quantized(call, q, scales, q.shape[0], numel, group_size, bits)
    return q.shape[0]


def _check_out(call: str, out, numel: int, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor) or out.numel() != numel or not out.is_contiguous() or out.device != device:
        raise ValueError(f"ds_ops.{call}: out must be a contiguous tensor of {numel} elements on {device}, got "
                         + (f"{tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else repr(out)))


def _threads(num_threads: int | None) -> int:
    if num_threads is None:
        return torch.get_num_threads()
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"ds_ops.quantize: num_threads must be a positive integer, got {num_threads!r}")
    return num_threads
