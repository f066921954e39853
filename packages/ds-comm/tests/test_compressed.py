"""compressed_allreduce's two implementations: ds-ops' kernels and the torch path give identical
frames (sign bytes and scales), error states and results, step by step in one process and end to
end on 2 gloo ranks (also with one rank on each path); the lazy error state against error feedback
written out eagerly from the formulas; the choice between them (ds-ops missing, its op not
buildable, tensors it does not take) and bad input named in the error."""

from __future__ import annotations

import logging
import math
import sys

import pytest
import torch

import ds_comm
from ds_comm import compressed
from ds_comm.testing import spawn


def _onebit():
    return pytest.importorskip("ds_ops.onebit", reason="ds-ops not installed: only the torch path to test")


def _data(n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x[::11] = 0.0
    return x


def _state(values: int, chunks: int, seed: int) -> torch.Tensor:
    """An error state as a call leaves it: the values, then a positive scale per chunk."""
    scales = torch.rand(chunks, generator=torch.Generator().manual_seed(seed)) * 0.1 + 0.01
    return torch.cat([_data(values, seed) * 0.1, scales])


def _error_of(state: torch.Tensor, chunks: int) -> torch.Tensor:
    """The error an error state stands for: value - scale where value >= 0, value + scale elsewhere."""
    values, scales = state[:-chunks].view(chunks, -1), state[-chunks:]
    return (values - torch.where(values >= 0, scales[:, None], -scales[:, None])).reshape(-1)


# (elements, world): padded sizes (not multiples of 8 * world), one to four ranks
CASES = [(8, 1), (1000, 2), (4097, 2), (333, 3), (70_001, 4)]


@pytest.mark.parametrize("n, world", CASES)
def test_each_step_gives_the_same_bytes_on_both_paths(n, world):
    onebit = _onebit()
    worker_size, server_size = ds_comm.error_buffer_sizes(n, world)
    padded, chunk = worker_size - world, server_size - 1
    assert padded == chunk * world and padded % (8 * world) == 0 and n <= padded < n + 8 * world
    frame = chunk // 8 + 4
    x, worker_error = _data(n, 0), _state(padded, world, 1)
    errors = {"torch": worker_error.clone(), "native": worker_error.clone()}
    frames = {path: torch.empty(world, frame, dtype=torch.uint8) for path in errors}
    compressed._compress_torch(x, errors["torch"], frames["torch"])
    onebit.compress(x, errors["native"], frames["native"])
    assert torch.equal(frames["torch"], frames["native"]) and torch.equal(errors["torch"], errors["native"])
    # the signs are pack_signs' bytes of x + error (padding: the error alone); the state keeps that
    work = _error_of(worker_error, world)
    work[:n] += x
    assert torch.equal(frames["torch"][:, : chunk // 8].reshape(-1), ds_comm.pack_signs(work))
    assert torch.equal(errors["torch"][:padded], work)

    received = frames["torch"]  # as if every rank had sent this rank these frames
    server_error = _state(chunk, 1, 2)
    servers = {"torch": server_error.clone(), "native": server_error.clone()}
    out = {path: torch.empty(frame, dtype=torch.uint8) for path in servers}
    compressed._average_torch(received, servers["torch"], out["torch"])
    onebit.average(received, servers["native"], out["native"])
    assert torch.equal(out["torch"], out["native"]) and torch.equal(servers["torch"], servers["native"])

    results = {"torch": torch.empty(n), "native": torch.empty(n)}
    compressed._decompress_torch(received, results["torch"])
    onebit.decompress(received, results["native"])
    assert torch.equal(results["torch"], results["native"])


@pytest.mark.parametrize("native", [False, True])
def test_the_lazy_state_is_the_eager_error_feedback(native):
    """Worker and server side, four calls: the frames of the lazy state are those of error feedback
    written out eagerly (keep e = w - ±scale, next w = x + e), and the error the state stands for is
    that e, bit for bit."""
    kernels = _onebit() if native else None
    n, world = 4097, 2
    worker_size, server_size = ds_comm.error_buffer_sizes(n, world)
    padded, chunk = worker_size - world, server_size - 1
    state, server_state = torch.zeros(worker_size), torch.zeros(server_size)
    eager, server_eager = torch.zeros(padded), torch.zeros(chunk)
    frames, out = torch.empty(world, chunk // 8 + 4, dtype=torch.uint8), torch.empty(chunk // 8 + 4, dtype=torch.uint8)
    for call in range(4):
        x = _data(n, 10 + call)
        if native:
            kernels.compress(x, state, frames)
        else:
            compressed._compress_torch(x, state, frames)
        w = eager.clone()
        w[:n] = x + eager[:n]
        rows = w.view(world, chunk)
        scales = (torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64) / math.sqrt(chunk)).float()
        assert torch.equal(compressed._frame_parts(frames)[1], scales)
        assert torch.equal(frames[:, : chunk // 8].reshape(-1), ds_comm.pack_signs(w))
        eager = (rows - torch.where(rows >= 0, scales[:, None], -scales[:, None])).view(-1)
        assert torch.equal(_error_of(state, world), eager)

        if native:
            kernels.average(frames, server_state, out)
        else:
            compressed._average_torch(frames, server_state, out)
        signs, scales, _ = compressed._frame_parts(frames)
        a = (ds_comm.unpack_signs(signs[0]) * scales[0] + ds_comm.unpack_signs(signs[1]) * scales[1]) / world
        a = a + server_eager
        scale = (torch.linalg.vector_norm(a, dtype=torch.float64) / math.sqrt(chunk)).float()
        assert torch.equal(compressed._frame_parts(out.view(1, -1))[1][0], scale)
        server_eager = a - torch.where(a >= 0, scale, -scale)
        assert torch.equal(_error_of(server_state, 1), server_eager)


def test_the_torch_path_keeps_other_dtypes():
    """bfloat16 tensors and bfloat16 error states: computed in float32, the state rounded back."""
    n, world = 1000, 2
    worker_size, server_size = ds_comm.error_buffer_sizes(n, world)
    chunk = server_size - 1
    x, error = _data(n, 3).bfloat16(), _state(worker_size - world, world, 4).bfloat16()
    frames, expected_frames = (torch.empty(world, chunk // 8 + 4, dtype=torch.uint8) for _ in range(2))
    expected_error = error.float()
    compressed._compress_torch(x.float(), expected_error, expected_frames)
    compressed._compress_torch(x, error, frames)
    assert torch.equal(frames, expected_frames) and torch.equal(error, expected_error.bfloat16())
    server, out, expected_out = _state(chunk, 1, 5).double(), *(torch.empty(chunk // 8 + 4, dtype=torch.uint8)
                                                                 for _ in range(2))
    expected_server = server.float()
    compressed._average_torch(frames, expected_server, expected_out)
    compressed._average_torch(frames, server, out)
    assert torch.equal(out, expected_out) and torch.equal(server, expected_server.double())


def test_error_buffer_sizes():
    assert ds_comm.error_buffer_sizes(100, 2) == (112 + 2, 56 + 1)
    assert ds_comm.error_buffer_sizes(0, 4) == (4, 1)
    with pytest.raises(ValueError, match=r"need numel >= 0 and world_size >= 1, got 10 and 0"):
        ds_comm.error_buffer_sizes(10, 0)


def _fresh(monkeypatch):
    monkeypatch.setattr(compressed, "_native", compressed._UNSET)  # restored after the test
    monkeypatch.setattr(compressed, "_native_problem", "")


def test_without_ds_ops_the_torch_path_runs_quietly(monkeypatch, caplog):
    _fresh(monkeypatch)
    monkeypatch.setitem(sys.modules, "ds_ops", None)  # import ds_ops now raises ImportError
    x, error, server_error = torch.zeros(16), torch.zeros(16), torch.zeros(8)
    with caplog.at_level(logging.INFO, logger="ds_comm.compressed"):
        assert compressed._kernels_for(None, x, error, server_error) is None
    assert caplog.records == []
    with pytest.raises(RuntimeError, match=r"native=True\): ds-ops is not installed .*pip install ds-comm\[ops\]"):
        compressed._kernels_for(True, x, error, server_error)


def test_an_op_that_cannot_be_built_falls_back_with_one_warning(monkeypatch, caplog):
    onebit = _onebit()
    from ds_ops import OpBuildError

    def broken():
        raise OpBuildError("building op onebit failed: no compiler")

    _fresh(monkeypatch)
    monkeypatch.setattr(onebit, "load", broken)
    x, error, server_error = torch.zeros(16), torch.zeros(16), torch.zeros(8)
    with caplog.at_level(logging.WARNING, logger="ds_comm.compressed"):
        assert compressed._kernels_for(None, x, error, server_error) is None
        assert compressed._kernels_for(None, x, error, server_error) is None
    (record,) = caplog.records  # said once, not per call
    assert "no compiler" in record.getMessage() and "compressing with torch ops instead" in record.getMessage()
    with pytest.raises(RuntimeError, match=r"onebit op cannot be built or loaded: building op onebit failed"):
        compressed._kernels_for(True, x, error, server_error)


def test_tensors_the_kernels_do_not_take_use_the_torch_path_or_are_named():
    onebit = _onebit()
    x, error, server_error = torch.zeros(16), torch.zeros(16), torch.zeros(8)
    assert compressed._kernels_for(None, x, error, server_error) is onebit
    assert compressed._kernels_for(False, x, error, server_error) is None
    assert compressed._kernels_for(None, x.double(), error, server_error) is None
    with pytest.raises(ValueError, match=r"worker_error must be a contiguous CPU float32 tensor for ds-ops' kernels, "
                                         r"got torch.float64 on cpu"):
        compressed._kernels_for(True, x, error.double(), server_error)
    with pytest.raises(ValueError, match=r"tensor must be .* got torch.float32 on cpu, not contiguous"):
        compressed._kernels_for(True, torch.zeros(16, 2)[:, 0], error, server_error)


def both_paths_agree(rank, world, sizes, calls):
    """Per size: `calls` all-reduces on the torch path, on the kernels, and mixed (rank 0 on the
    kernels, rank 1 on torch ops): results and both errors after every call. Then bad input."""
    out = []
    for n in sizes:
        runs = {}
        for name, native in (("torch", False), ("native", True), ("mixed", rank == 0)):
            worker_error, server_error = (torch.zeros(size) for size in ds_comm.error_buffer_sizes(n, world))
            x = _data(n, rank)
            steps = []
            for _ in range(calls):
                y = x.clone()
                assert ds_comm.compressed_allreduce(y, worker_error, server_error, native=native) is y
                steps.append((y, worker_error.clone(), server_error.clone()))
            runs[name] = steps
        out.append(all(torch.equal(a, b) for name in ("native", "mixed")
                       for step, other in zip(runs["torch"], runs[name], strict=True)
                       for a, b in zip(step, other, strict=True)))
    y, worker_error, server_error = torch.zeros(100), torch.zeros(114), torch.zeros(57)
    with pytest.raises(ValueError, match=r"native must be None, True or False, got 'yes'"):
        ds_comm.compressed_allreduce(y, worker_error, server_error, native="yes")
    with pytest.raises(ValueError, match=r"worker_error needs 114 and server_error 57 elements, got 112 and 57"):
        ds_comm.compressed_allreduce(y, torch.zeros(112), server_error)
    with pytest.raises(ValueError, match=r"tensor must be a contiguous CPU float32 tensor .* got torch.float16"):
        ds_comm.compressed_allreduce(y.half(), worker_error, server_error, native=True)
    return out


def test_both_paths_give_identical_results_on_two_ranks():
    _onebit()
    results = spawn(both_paths_agree, world_size=2, args=([1000, 4097, 40_003], 4))
    assert results == [[True, True, True]] * 2


def allocations_per_call(rank, world, n):
    """The largest allocation torch's CPU allocator sees during a warm call, per path."""
    from torch.profiler import ProfilerActivity, profile

    errors = [torch.zeros(size) for size in ds_comm.error_buffer_sizes(n, world)]
    x = _data(n, rank)
    largest = {}
    for native in (False, True):
        ds_comm.compressed_allreduce(x.clone(), *errors, native=native)  # warm: the scratch is allocated once
        y = x.clone()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            ds_comm.compressed_allreduce(y, *errors, native=native)
        largest[native] = max((e.self_cpu_memory_usage for e in prof.events()), default=0)
    return largest


def test_a_warm_call_on_the_kernels_allocates_no_frames():
    """The frames live in a reused staging buffer: fresh ones were paged in on every call (3.7 ms per
    8 MiB here). The torch path's temporaries are the control: the profiler does see allocations."""
    _onebit()
    n, world = 1 << 18, 2
    frames_bytes = world * ((ds_comm.error_buffer_sizes(n, world)[1] - 1) // 8 + 4)
    for largest in spawn(allocations_per_call, world_size=world, args=(n,)):
        assert largest[False] >= frames_bytes  # control: the torch path allocates (its unpacked signs)
        assert largest[True] < frames_bytes // world, largest


def logged_and_strided(rank, world, n):
    """The comms logger's records of one call; a non-contiguous tensor on the torch path against a
    contiguous one."""
    sizes = ds_comm.error_buffer_sizes(n, world)
    x = _data(n, rank)
    ds_comm.configure(enabled=True)
    ds_comm.comms_logger.reset()
    ds_comm.compressed_allreduce(x.clone(), *(torch.zeros(size) for size in sizes))
    records = [(r.op, r.msg_bytes, r.count, r.bus_bytes) for r in ds_comm.comms_logger.records()]
    ds_comm.comms_logger.reset()
    ds_comm.configure(enabled=False)
    runs = []
    for strided in (False, True):
        errors = [torch.zeros(size) for size in sizes]
        y = torch.zeros(n, 2)[:, 0] if strided else torch.zeros(n)
        y.copy_(x)
        for _ in range(2):
            ds_comm.compressed_allreduce(y, *errors, native=False)
        runs.append([y.contiguous(), *errors])
    return records, all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_the_exchanges_are_logged_as_collectives_and_strided_tensors_work():
    n, world = 4097, 2
    frames_bytes = world * ((ds_comm.error_buffer_sizes(n, world)[1] - 1) // 8 + 4)
    for records, same in spawn(logged_and_strided, world_size=world, args=(n,)):
        # each rank sends one frame in each exchange: what all_to_all_single and all_gather send
        assert sorted(records) == [("all_gather_bucket", frames_bytes, 1, frames_bytes // 2),
                                   ("all_to_all_single", frames_bytes, 1, frames_bytes // 2)]
        assert same
