"""TensorSwapper: thousands of odd-sized tensors out and back, compared byte for byte with the
originals; failed writes leave the old file under the final name."""

from __future__ import annotations

import os
import resource
import signal

import pytest
import torch

from ds_io import AioConfig, TensorSwapper

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.bool, torch.int16]


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def make_tensors(count: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 1500, (count,), generator=g).tolist()
    sizes[:4] = [0, 1, 4096, 70_001]  # empty, one element, aligned, larger than a buffer (chunked)
    out = []
    for k, n in enumerate(sizes):
        dtype = DTYPES[k % len(DTYPES)]
        raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
        t = (raw % 2 if dtype == torch.bool else raw).view(dtype)
        out.append(t.reshape(-1, 1) if k % 5 == 0 else t)
    return out


def test_thousands_of_odd_tensors_round_trip(tmp_path):
    tensors = make_tensors(2000)
    keys = [f"param.{k}" for k in range(len(tensors))]
    config = AioConfig(block_size=16384, queue_depth=4, thread_count=2)
    with TensorSwapper(tmp_path / "swap", config, buffer_count=3, buffer_size=65536) as swapper:
        swapper.swap_out(tensors, keys)
        for key, t in zip(keys[:50], tensors[:50], strict=True):  # the files hold exactly the bytes
            assert swapper.path_of(key).read_bytes() == tensor_bytes(t)
        back = swapper.swap_in(keys)
        for t, u in zip(tensors, back, strict=True):
            assert u.dtype == t.dtype and u.shape == t.shape and tensor_bytes(u) == tensor_bytes(t)
        # into given tensors, asynchronously, in another order
        order = list(reversed(range(len(keys))))
        outs = [torch.empty_like(tensors[k]) for k in order]
        assert swapper.swap_in_async([keys[k] for k in order], out=outs) is not None
        swapper.wait()
        for k, u in zip(order, outs, strict=True):
            assert tensor_bytes(u) == tensor_bytes(tensors[k])
        swapper.release(keys)
        assert swapper.keys() == [] and list((tmp_path / "swap").iterdir()) == []


def test_async_swap_out_copies_so_the_source_may_change(tmp_path):
    with TensorSwapper(tmp_path, buffer_count=2, buffer_size=8192) as swapper:
        t = torch.arange(5000, dtype=torch.int32)
        expected = tensor_bytes(t)
        swapper.swap_out_async([t], ["t"])
        t.zero_()
        swapper.wait()
        assert tensor_bytes(swapper.swap_in(["t"])[0]) == expected


def test_failed_write_keeps_the_old_file(tmp_path):
    old = torch.arange(1000, dtype=torch.float32)
    with TensorSwapper(tmp_path, buffer_count=2, buffer_size=65536) as swapper:
        swapper.swap_out([old], ["w"])
        previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))  # a "full disk" at 100 kB
        try:
            with pytest.raises(OSError, match=r"File too large.*key 'w' was not swapped out"):
                swapper.swap_out([torch.ones(200_000)], ["w"])
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, previous_handler)
        assert tensor_bytes(swapper.swap_in(["w"])[0]) == tensor_bytes(old)
        assert [p.name for p in tmp_path.iterdir()] == [swapper.path_of("w").name]  # no temp file left


def test_errors_name_the_key(tmp_path):
    with TensorSwapper(tmp_path, buffer_size=8192) as swapper:
        with pytest.raises(KeyError, match="swap_in: unknown key 'nope' \\(0 keys are swapped out\\)"):
            swapper.swap_in(["nope"])
        with pytest.raises(ValueError, match="swap_out: 2 tensors but 1 keys"):
            swapper.swap_out([torch.ones(1), torch.ones(1)], ["a"])
        swapper.swap_out([torch.ones(4)], ["a"])
        with pytest.raises(ValueError, match="swap_in: key 'a' holds 16 bytes"):
            swapper.swap_in(["a"], out=[torch.empty(3)])
        swapper.release(["a"])
        with pytest.raises(KeyError, match="release: unknown key 'a'"):
            swapper.release(["a"])
    with pytest.raises(ValueError, match="buffer_size must be an integer number of bytes >= 4096, got 100"):
        TensorSwapper(tmp_path, buffer_size=100)
    with pytest.raises(ValueError, match="buffer_count must be an integer >= 1, got 0"):
        TensorSwapper(tmp_path, buffer_count=0)


def test_swap_dir_is_created_and_use_gds_is_checked(tmp_path):
    TensorSwapper(tmp_path / "a" / "b", {"thread_count": 1}, buffer_size=4096).close()
    assert (tmp_path / "a" / "b").is_dir()
    from ds_io import gds_available
    if not gds_available():
        with pytest.raises(RuntimeError, match=r"aio\.use_gds is true, but NVIDIA GPUDirect Storage is not available"):
            TensorSwapper(tmp_path, {"use_gds": True})
    assert os.listdir(tmp_path) == ["a"]
