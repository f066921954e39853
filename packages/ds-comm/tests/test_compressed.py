"""compressed_allreduce's two implementations: ds-ops' kernels and the torch path give identical
frames (sign bytes and scales), errors and results, step by step in one process and end to end on
2 gloo ranks (also with one rank on each path); the choice between them (ds-ops missing, its op
not buildable, tensors it does not take) and bad input named in the error."""

from __future__ import annotations

import logging
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


# (elements, world): padded sizes (not multiples of 8 * world), one to four ranks
CASES = [(8, 1), (1000, 2), (4097, 2), (333, 3), (70_001, 4)]


@pytest.mark.parametrize("n, world", CASES)
def test_each_step_gives_the_same_bytes_on_both_paths(n, world):
    onebit = _onebit()
    padded, chunk = ds_comm.error_buffer_sizes(n, world)
    frame = chunk // 8 + 4
    x, worker_error = _data(n, 0), _data(padded, 1) * 0.1
    errors = {"torch": worker_error.clone(), "native": worker_error.clone()}
    frames = {path: torch.empty(world, frame, dtype=torch.uint8) for path in errors}
    compressed._compress_torch(x, errors["torch"], frames["torch"])
    onebit.compress(x, errors["native"], frames["native"])
    assert torch.equal(frames["torch"], frames["native"]) and torch.equal(errors["torch"], errors["native"])
    # the torch path's signs are pack_signs' bytes of x + error (padding: the error alone)
    work = worker_error.clone()
    work[:n] += x
    assert torch.equal(frames["torch"][:, : chunk // 8].reshape(-1), ds_comm.pack_signs(work))

    received = frames["torch"]  # as if every rank had sent this rank these frames
    server_error = _data(chunk, 2) * 0.1
    servers = {"torch": server_error.clone(), "native": server_error.clone()}
    out = {path: torch.empty(frame, dtype=torch.uint8) for path in servers}
    compressed._average_torch(received, servers["torch"], out["torch"])
    onebit.average(received, servers["native"], out["native"])
    assert torch.equal(out["torch"], out["native"]) and torch.equal(servers["torch"], servers["native"])

    results = {"torch": torch.empty(n), "native": torch.empty(n)}
    compressed._decompress_torch(received, results["torch"])
    onebit.decompress(received, results["native"])
    assert torch.equal(results["torch"], results["native"])


def test_the_torch_path_keeps_other_dtypes():
    """bfloat16 tensors and a bfloat16 error buffer: computed in float32, the error rounded back."""
    n, world = 1000, 2
    padded, _ = ds_comm.error_buffer_sizes(n, world)
    x, error = _data(n, 3).bfloat16(), (_data(padded, 4) * 0.1).bfloat16()
    frames, expected_frames = (torch.empty(world, padded // world // 8 + 4, dtype=torch.uint8) for _ in range(2))
    expected_error = error.float()
    compressed._compress_torch(x.float(), expected_error, expected_frames)
    compressed._compress_torch(x, error, frames)
    assert torch.equal(frames, expected_frames) and torch.equal(error, expected_error.bfloat16())


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
            padded, chunk = ds_comm.error_buffer_sizes(n, world)
            worker_error, server_error = torch.zeros(padded), torch.zeros(chunk)
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
    y, worker_error, server_error = torch.zeros(100), torch.zeros(112), torch.zeros(56)
    with pytest.raises(ValueError, match=r"native must be None, True or False, got 'yes'"):
        ds_comm.compressed_allreduce(y, worker_error, server_error, native="yes")
    with pytest.raises(ValueError, match=r"worker_error needs 112 and server_error 56 elements, got 100 and 56"):
        ds_comm.compressed_allreduce(y, torch.zeros(100), server_error)
    with pytest.raises(ValueError, match=r"tensor must be a contiguous CPU float32 tensor .* got torch.float16"):
        ds_comm.compressed_allreduce(y.half(), worker_error, server_error, native=True)
    return out


def test_both_paths_give_identical_results_on_two_ranks():
    _onebit()
    results = spawn(both_paths_agree, world_size=2, args=([1000, 4097, 40_003], 4))
    assert results == [[True, True, True]] * 2
