"""The 1-bit compression kernels (``ds_ops.onebit``) against a PyTorch reference written here from
the formulas: the sign bytes and the errors bit for bit, the scales to the last bit of float32
(the kernel sums the squares in double in its own order; the reference sums them exactly with
math.fsum). Sizes with a padded last chunk, one to four chunks, one and two threads, the portable
(scalar) kernels, and bad buffers named in the error. An error state (the values last compressed,
then a scale per chunk) stands for the error ``values - ±scale``: the reference computes that error
and the next values from it, as the formulas say."""

from __future__ import annotations

import ctypes
import math
import subprocess

import pytest
import torch

from ds_ops import onebit
from ds_ops.op_builder import csrc_root, system

SHIFTS = torch.arange(8, dtype=torch.uint8)


# ---- the reference ----------------------------------------------------------------------------------
def ref_signs(values: torch.Tensor) -> torch.Tensor:
    """Bit i of byte j: element 8j+i >= 0."""
    bits = (values.reshape(-1, 8) >= 0).to(torch.uint8)
    return (bits << SHIFTS).sum(dim=1, dtype=torch.uint8)


def ref_scale(row: torch.Tensor) -> float:
    """The RMS of a float32 row: squares exact in float64, summed exactly, one rounding to float32."""
    square_sum = math.fsum(v * v for v in row.double().tolist())
    return float(torch.tensor(math.sqrt(square_sum) / math.sqrt(row.numel()), dtype=torch.float64).float())


def frame_scales(frames: torch.Tensor) -> torch.Tensor:
    return frames[:, -onebit.SCALE_BYTES:].reshape(-1).clone().view(torch.float32)  # clone: offset 0


def decoded(frames: torch.Tensor) -> torch.Tensor:
    """±scale of every element of the frames, in order."""
    k, size = frames.shape
    bits = (frames[:, : size - onebit.SCALE_BYTES].reshape(-1, 1) >> SHIFTS) & 1
    scales = frame_scales(frames)
    return torch.where(bits.view(k, -1).bool(), scales[:, None], -scales[:, None]).view(-1)


def check_frames(frames: torch.Tensor, rows: torch.Tensor) -> None:
    """frames hold rows' signs exactly and their RMS to the last bit of float32."""
    chunk = rows.shape[1]
    assert torch.equal(frames[:, : chunk // 8], ref_signs(rows).view(rows.shape[0], -1))
    expected = torch.tensor([ref_scale(row) for row in rows])
    torch.testing.assert_close(frame_scales(frames), expected, rtol=2.0**-23, atol=0.0)


def data(n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x[::13] = 0.0  # zero is >= 0
    x[5::29] = -0.0  # and so is -0.0
    return x


# sizes: (tensor elements, chunks); the padded size is a multiple of 8 * chunks
CASES = [(8, 1), (1000, 2), (4097, 2), (333, 3), (100_003, 3), (70_001, 4)]


def padded(n: int, chunks: int) -> int:
    unit = 8 * chunks
    return (n + unit - 1) // unit * unit


def random_state(chunks: int, chunk: int, seed: int) -> torch.Tensor:
    """An error state as a previous call leaves it: values, then a positive scale per chunk."""
    values = data(chunks * chunk, seed) * 0.1
    scales = torch.rand(chunks, generator=torch.Generator().manual_seed(seed)) * 0.1 + 0.01
    return torch.cat([values, scales])


def ref_error(state: torch.Tensor, chunks: int) -> torch.Tensor:
    """The error a state stands for: values - scale where values >= 0, values + scale elsewhere."""
    values, scales = state[:-chunks].view(chunks, -1), state[-chunks:]
    return (values - torch.where(values >= 0, scales[:, None], -scales[:, None])).view(-1)


@pytest.mark.parametrize("n, chunks", CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_compress_matches_the_reference(n, chunks, threads):
    size = padded(n, chunks)
    chunk = size // chunks
    x, state = data(n, 0), random_state(chunks, chunk, 1)
    work = ref_error(state, chunks)
    work[:n] += x  # w = x + error; the padding is the error alone
    frames = torch.empty(chunks, onebit.frame_bytes(chunk), dtype=torch.uint8)
    assert onebit.state_size(chunks, chunk) == state.numel()
    assert onebit.compress(x, state, frames, num_threads=threads) is frames
    rows = work.view(chunks, -1)
    check_frames(frames, rows)
    assert torch.equal(state[:size], work) and torch.equal(state[size:], frame_scales(frames))


@pytest.mark.parametrize("n, chunks", [(4097, 2), (333, 3), (70_001, 4)])
def test_compressing_one_chunk_at_a_time_is_compressing_all(n, chunks):
    """``index``: chunk by chunk, in any order, the same frames and state as all at once; the other
    chunks' frames and state untouched."""
    size = padded(n, chunks)
    chunk = size // chunks
    x, state = data(n, 10), random_state(chunks, chunk, 11)
    whole, parts = torch.empty(2, chunks, onebit.frame_bytes(chunk), dtype=torch.uint8)
    expected = state.clone()
    onebit.compress(x, expected, whole, num_threads=1)
    for c in reversed(range(chunks)):
        before, frames_before = state.clone(), parts.clone()
        onebit.compress(x, state, parts, num_threads=1, index=c)
        changed = torch.zeros(state.numel(), dtype=torch.bool)
        changed[c * chunk:(c + 1) * chunk] = changed[size + c] = True
        assert torch.equal(state[changed], expected[changed]) and torch.equal(state[~changed], before[~changed])
        assert torch.equal(parts[c], whole[c]) and torch.equal(parts[:c], frames_before[:c])
    with pytest.raises(ValueError, match=rf"index must be a chunk index in \[0, {chunks}\), got {chunks}"):
        onebit.compress(x, state, parts, index=chunks)
    with pytest.raises(ValueError, match=r"index must be a chunk index .* got True"):
        onebit.compress(x, state, parts, index=True)


def test_a_zero_state_is_no_error():
    n, chunks = 1000, 2
    x, state = data(n, 9), torch.zeros(onebit.state_size(chunks, 504))
    frames = torch.empty(chunks, onebit.frame_bytes(504), dtype=torch.uint8)
    onebit.compress(x, state, frames)
    work = torch.cat([x, torch.zeros(8)])
    check_frames(frames, work.view(chunks, -1))
    assert torch.equal(state[:1008], work)


@pytest.mark.parametrize("n, world", CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_average_matches_the_reference(n, world, threads):
    chunk = padded(n, world) // world
    frames = torch.empty(world, onebit.frame_bytes(chunk), dtype=torch.uint8)
    onebit.compress(data(world * chunk, 2), torch.zeros(onebit.state_size(world, chunk)), frames)  # real data
    server_error = random_state(1, chunk, 3)
    expected = decoded(frames[:1])
    for r in range(1, world):  # (±s_0 + ±s_1 + ...) / world, added in rank order, then the error
        expected += decoded(frames[r:r + 1])
    expected = expected / world + ref_error(server_error, 1)
    out = torch.empty(onebit.frame_bytes(chunk), dtype=torch.uint8)
    assert onebit.average(frames, server_error, out, num_threads=threads) is out
    check_frames(out.view(1, -1), expected.view(1, -1))
    assert torch.equal(server_error[:chunk], expected)
    assert torch.equal(server_error[chunk:], frame_scales(out.view(1, -1)))


@pytest.mark.parametrize("n, chunks", CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_decompress_writes_only_the_unpadded_elements(n, chunks, threads):
    size = padded(n, chunks)
    frames = torch.empty(chunks, onebit.frame_bytes(size // chunks), dtype=torch.uint8)
    onebit.compress(data(size, 4), torch.zeros(onebit.state_size(chunks, size // chunks)), frames)
    out = torch.full((n + 1,), 7.0)  # one element past the end must stay untouched
    assert torch.equal(onebit.decompress(frames, out[:n], num_threads=threads), decoded(frames)[:n])
    assert out[n] == 7.0


def test_error_feedback_averages_to_the_input():
    """Compressing the same input again and again with the error fed back: the mean of the
    decompressed values converges to the input (the errors stay bounded)."""
    n, chunks = 4096, 2
    x, state = data(n, 5), torch.zeros(onebit.state_size(chunks, n // chunks))
    frames = torch.empty(chunks, onebit.frame_bytes(n // chunks), dtype=torch.uint8)
    total, out = torch.zeros(n), torch.empty(n)
    for _ in range(200):
        total += onebit.decompress(onebit.compress(x, state, frames), out)
    assert ((total / 200 - x).norm() / x.norm()).item() < 0.02


def test_bad_buffers_are_named():
    frames = torch.empty(2, onebit.frame_bytes(64), dtype=torch.uint8)
    x, error = torch.zeros(100), torch.zeros(130)
    with pytest.raises(ValueError, match=r"tensor must be a contiguous CPU float32 tensor, got torch.float64"):
        onebit.compress(x.double(), error, frames)
    with pytest.raises(ValueError, match=r"error must be a contiguous CPU float32 tensor, .*not contiguous"):
        onebit.compress(x, torch.zeros(260)[::2], frames)
    with pytest.raises(ValueError, match=r"error must have 130 elements \(the values and a scale per chunk\) and "
                                         r"tensor at most 128; got error 128, tensor 100"):
        onebit.compress(x, torch.zeros(128), frames)
    with pytest.raises(ValueError, match=r"tensor at most 128; got error 130, tensor 129"):
        onebit.compress(torch.zeros(129), error, frames)
    with pytest.raises(ValueError, match=r"frames must be a contiguous CPU uint8 tensor, got torch.int8"):
        onebit.compress(x, error, frames.to(torch.int8))
    with pytest.raises(ValueError, match=r"frames must be \[frames, chunk / 8 \+ 4\] bytes"):
        onebit.compress(x, error, frames.view(-1))
    with pytest.raises(ValueError, match=r"server_error must have 65 elements and out 12 bytes; got 65 and 11"):
        onebit.average(frames, torch.zeros(65), torch.empty(11, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"server_error must have 65 elements and out 12 bytes; got 64 and 12"):
        onebit.average(frames, torch.zeros(64), torch.empty(12, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"frames .* hold 128 values, out has 129 elements"):
        onebit.decompress(frames, torch.empty(129))
    with pytest.raises(ValueError, match=r"num_threads must be a positive integer, got 0"):
        onebit.decompress(frames, torch.empty(128), num_threads=0)
    with pytest.raises(ValueError, match=r"positive multiple of 8 values, got 12"):
        onebit.frame_bytes(12)
    with pytest.raises(ValueError, match=r"need at least one chunk, got 0"):
        onebit.state_size(0, 64)


# The portable kernels (no AVX2): onebit.cpp compiled with no SIMD flags behind a C shim and called
# through ctypes, a 2-second build instead of a whole op with pybind11.
SCALAR_SHIM = """
#include "onebit.cpp"
#if defined(__AVX2__)
#error "the scalar check must build without AVX2"
#endif
extern "C" {
void compress(int64_t x, int64_t n, int64_t v, int64_t s, int64_t k, int64_t c, int64_t f) {
  ds::onebit_compress(x, n, v, s, k, c, f, 2);
}
void average(int64_t f, int64_t w, int64_t c, int64_t v, int64_t s, int64_t o) { ds::onebit_average(f, w, c, v, s, o, 2); }
void decompress(int64_t f, int64_t k, int64_t c, int64_t o, int64_t n) { ds::onebit_decompress(f, k, c, o, n, 2); }
}
"""


def test_the_scalar_build_computes_the_same_bytes(tmp_path):
    compiler = system.compiler()
    if compiler is None:
        pytest.skip("no C++ compiler")
    (tmp_path / "shim.cpp").write_text(SCALAR_SHIM)
    root = csrc_root()
    subprocess.run([*compiler.split(), "-O2", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off",
                    f"-I{root / 'common'}", f"-I{root / 'onebit'}", str(tmp_path / "shim.cpp"), "-o",
                    str(tmp_path / "shim.so")], check=True, capture_output=True, timeout=120)
    shim = ctypes.CDLL(str(tmp_path / "shim.so"))
    for name, arity in (("compress", 7), ("average", 6), ("decompress", 5)):
        getattr(shim, name).argtypes = [ctypes.c_int64] * arity
    n, chunks = 100_003, 3
    size = padded(n, chunks)
    chunk = size // chunks
    x, error, server_error = data(n, 6), random_state(chunks, chunk, 7), random_state(1, chunk, 8)
    ours = [torch.empty(chunks, onebit.frame_bytes(chunk), dtype=torch.uint8), error.clone(),
            torch.empty(onebit.frame_bytes(chunk), dtype=torch.uint8), server_error.clone(), torch.empty(n)]
    scalar = [t.clone() for t in ours]
    onebit.compress(x, ours[1], ours[0], num_threads=2)
    onebit.average(ours[0], ours[3], ours[2], num_threads=2)
    onebit.decompress(ours[0], ours[4], num_threads=2)
    shim.compress(x.data_ptr(), n, scalar[1].data_ptr(), scalar[1][size:].data_ptr(), chunks, chunk,
                  scalar[0].data_ptr())
    shim.average(scalar[0].data_ptr(), chunks, chunk, scalar[3].data_ptr(), scalar[3][chunk:].data_ptr(),
                 scalar[2].data_ptr())
    shim.decompress(scalar[0].data_ptr(), chunks, chunk, scalar[4].data_ptr(), n)
    for a, b in zip(ours, scalar, strict=True):
        assert torch.equal(a, b)
