"""Block quantization (``ds_ops.quantize_blockwise`` and its inverses) against values worked out by
hand and against the error bound, on the CPU kernel and the torch path (``native=False``, the device
path); the two agree bit for bit at every SIMD level (test_kernel_matrix.py). Bad arguments are named."""

from __future__ import annotations

import math

import pytest
import torch

import ds_ops
from ds_ops.quantize import num_groups, quantized_bytes

PATHS = [None, False]  # the CPU kernel, the torch (device) path


@pytest.mark.parametrize("native", PATHS)
def test_rounding_is_half_to_even_and_scales_are_absmax_over_qmax(native):
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, -127.0, 3.49, 7.0, 0.5, -1.5, 6.5])
    q, scales = ds_ops.quantize_blockwise(x, 12, 8, native=native)
    assert q.dtype == torch.int8 and scales.tolist() == [1.0]
    assert q.tolist() == [127, 0, 2, 2, 0, -2, -127, 3, 7, 0, -2, 6]
    q4, s4 = ds_ops.quantize_blockwise(torch.tensor([7.0, 0.5, 1.5, 2.5, -0.5, -2.5, -7.0]), 8, 4, native=native)
    assert s4.tolist() == [1.0]
    # pairs (7, 0) (2, 2) (0, -2) (-7, pad 0): high nibble first, two's complement nibbles
    assert q4.dtype == torch.uint8 and q4.tolist() == [0x70, 0x22, 0x0E, 0x90]


@pytest.mark.parametrize("native", PATHS)
def test_zero_inf_nan_and_underflowing_groups(native):
    x = torch.tensor([0.0, -0.0, 0.0, 0.0, 1.0, math.inf, 2.0, 3.0, math.nan, 1.0, 1.0, 1.0, 1e-44, -1e-44, 0.0, 0.0])
    q, scales = ds_ops.quantize_blockwise(x, 4, 8, native=native)
    assert scales[0].item() == 0.0 and scales[3].item() == 0.0  # zeros; 1e-44 / 127 underflows to 0
    assert scales[1].isnan() and scales[2].isnan()
    assert q.tolist() == [0] * 16
    y = ds_ops.dequantize_blockwise(q, scales, 16, 4, 8, native=native)
    assert y[:4].tolist() == [0.0] * 4 and y[12:].tolist() == [0.0] * 4 and bool(y[4:12].isnan().all())


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("bits", [8, 4])
def test_the_error_is_within_half_a_scale(native, bits):
    """|x - x'| <= scale/2 (1 + 2^-16) + 2^-24 |x| for normal scales; subnormal scales add at most
    qmax * 2^-150 (their rounding); float16/bfloat16 outputs add their own rounding of x'."""
    qmax = 127 if bits == 8 else 7
    for scale_of_x in (1.0, 1e-30, 1e-39, 3e37):
        x = torch.randn(10_001, generator=torch.Generator().manual_seed(1)) * scale_of_x
        q, scales = ds_ops.quantize_blockwise(x, 64, bits, native=native)
        y = ds_ops.dequantize_blockwise(q, scales, x.numel(), 64, bits, native=native)
        s = scales.repeat_interleave(64)[: x.numel()].double()
        bound = s / 2 * (1 + 2.0**-16) + x.double().abs() * 2.0**-24 + qmax * 2.0**-150
        assert bool(((x.double() - y.double()).abs() <= bound).all()), scale_of_x
        for dtype, eps in ((torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)):
            if scale_of_x != 1.0:
                continue
            z = ds_ops.dequantize_blockwise(q, scales, x.numel(), 64, bits, dtype, native=native)
            assert bool(((x.double() - z.double()).abs() <= bound + y.double().abs() * eps).all())


@pytest.mark.parametrize("native", PATHS)
def test_sums_add_in_tensor_order_and_requantize(native):
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    parts = [ds_ops.quantize_blockwise(x, 50, 4, native=native) for x in xs]
    q, scales = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    deq = [ds_ops.dequantize_blockwise(p[0], p[1], 1000, 50, 4, native=native) for p in parts]
    total = ds_ops.dequantize_sum_blockwise(q, scales, 1000, 50, 4, native=native)
    assert torch.equal(total, (deq[0] + deq[1]) + deq[2])
    rq, rs = ds_ops.requantize_sum_blockwise(q, scales, 1000, 50, 4, out_bits=8, native=native)
    eq, es = ds_ops.quantize_blockwise(total, 50, 8, native=native)
    assert torch.equal(rq, eq) and torch.equal(rs, es)


def test_threads_and_flush_modes_do_not_change_the_bytes():
    x = torch.randn(200_003, generator=torch.Generator().manual_seed(2)) * 1e-38  # subnormal scales
    first = ds_ops.quantize_blockwise(x, 1024, 4, num_threads=1)
    assert bool((first[1] < 1.1754944e-38).all() & (first[1] > 0).all())
    for threads in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(first, ds_ops.quantize_blockwise(x, 1024, 4, num_threads=threads),
                                                     strict=True))
    if torch.set_flush_denormal(True):
        try:
            flushed = ds_ops.quantize_blockwise(x, 1024, 4, num_threads=1)
        finally:
            torch.set_flush_denormal(False)
        assert all(torch.equal(a, b) for a, b in zip(first, flushed, strict=True))


def test_sizes_and_empty_tensors():
    assert (num_groups(10, 4), quantized_bytes(7, 4), quantized_bytes(7, 8)) == (3, 4, 7)
    q, s = ds_ops.quantize_blockwise(torch.empty(0), 16, 4)
    assert q.numel() == 0 and s.numel() == 0
    assert ds_ops.dequantize_blockwise(q, s, 0, 16, 4).numel() == 0
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    q, s = ds_ops.quantize_blockwise(x, 4, 8)
    out = torch.empty(3, 5, dtype=torch.bfloat16)
    assert ds_ops.dequantize_blockwise(q, s, 15, 4, 8, out=out) is out


def test_bad_arguments_are_named():
    x = torch.randn(10)
    with pytest.raises(ValueError, match=r"bits must be 8 or 4, got 2"):
        ds_ops.quantize_blockwise(x, 4, 2)
    with pytest.raises(ValueError, match=r"group_size must be a positive integer, even for int4, got 3"):
        ds_ops.quantize_blockwise(x, 3, 4)
    with pytest.raises(ValueError, match=r"group_size must be a positive integer, got 0"):
        ds_ops.quantize_blockwise(x, 0)
    with pytest.raises(ValueError, match=r"x must be float32, float16 or bfloat16, got torch.float64"):
        ds_ops.quantize_blockwise(x.double(), 4)
    q, s = ds_ops.quantize_blockwise(x, 4)
    with pytest.raises(ValueError, match=r"need q of 11 bytes and 3 scales, got 10 and 3"):
        ds_ops.dequantize_blockwise(q, s, 11, 4)
    with pytest.raises(ValueError, match=r"q of 4-bit values must be torch.uint8, got torch.int8"):
        ds_ops.dequantize_blockwise(q, s, 10, 4, 4)
    with pytest.raises(ValueError, match=r"dtype must be torch.float32, torch.float16 or torch.bfloat16"):
        ds_ops.dequantize_blockwise(q, s, 10, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q must be a \[k, bytes\] tensor"):
        ds_ops.dequantize_sum_blockwise(q, s, 10, 4)
    with pytest.raises(ValueError, match=r"native must be None, True or False, got 1"):
        ds_ops.quantize_blockwise(x, 4, native=1)
    with pytest.raises(ValueError, match=r"num_threads must be a positive integer, got 0"):
        ds_ops.quantize_blockwise(x, 4, num_threads=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bits", [8, 4])
def test_the_device_path_gives_the_cpu_kernel_bytes(bits):
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(3))
    x[::101] = 0.0
    cpu = ds_ops.quantize_blockwise(x, 2048, bits)
    gpu = ds_ops.quantize_blockwise(x.cuda(), 2048, bits)
    assert gpu[0].is_cuda and all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu, strict=True))
    y = ds_ops.dequantize_blockwise(*gpu, x.numel(), 2048, bits, torch.bfloat16)
    assert torch.equal(y.cpu(), ds_ops.dequantize_blockwise(*cpu, x.numel(), 2048, bits, torch.bfloat16))
