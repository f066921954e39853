"""The aio handle against independent references: the file's bytes read with plain Python I/O,
and the tensor's own bytes."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

import ds_io
import ds_ops
from ds_io import _limits
from ds_io.handle import AsyncIOHandle, _core

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.bool, torch.float64]


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def random_tensor(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype)


@pytest.fixture(scope="module")
def handle():
    with AsyncIOHandle(block_size=3 * 4096, queue_depth=4, intra_op_parallelism=3) as h:
        yield h


@pytest.mark.parametrize("use_libaio", [True, False], ids=["libaio", "posix"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("numel", [1, 4095, 4096 * 5, 100_003])
@pytest.mark.parametrize("block_size", [8192, 1024], ids=["8k", "1k"])  # 1024: DeepSpeed's tests' size
def test_roundtrip_matches_file_bytes(tmp_path, use_libaio, direct, numel, block_size):
    with AsyncIOHandle(block_size=block_size, queue_depth=3, intra_op_parallelism=2, overlap_events=use_libaio,
                       use_direct_io=direct, use_libaio=use_libaio) as h:
        for k, dtype in enumerate(DTYPES):
            t = random_tensor(numel, dtype, seed=k)
            path = tmp_path / f"t{k}.bin"
            h.sync_pwrite(t, path)
            assert path.read_bytes() == tensor_bytes(t)
            u = torch.empty_like(t)
            h.sync_pread(u, path)
            assert tensor_bytes(u) == tensor_bytes(t)


def test_locked_tensor_is_aligned_and_roundtrips_through_libaio(tmp_path, handle):
    example = torch.empty(0, dtype=torch.bfloat16)
    t = handle.new_cpu_locked_tensor(50_000, example)
    assert t.dtype == torch.bfloat16 and t.shape == (50_000,) and t.data_ptr() % 4096 == 0
    t.copy_(random_tensor(50_000, torch.bfloat16))
    handle.sync_pwrite(t, tmp_path / "locked.bin")
    u = handle.new_cpu_locked_tensor(50_000, example)
    handle.sync_pread(u, tmp_path / "locked.bin")
    assert tensor_bytes(u) == tensor_bytes(t) == (tmp_path / "locked.bin").read_bytes()
    assert handle.free_cpu_locked_tensor(t) is True
    assert handle.free_cpu_locked_tensor(t) is False  # freed already: DeepSpeed's False
    assert handle.free_cpu_locked_tensor(torch.empty(10)) is False  # never made by the handle
    assert handle.free_cpu_locked_tensor(u) is True
    with pytest.raises(ValueError, match="num_elem must be a positive integer, got 0"):
        handle.new_cpu_locked_tensor(0, example)


def test_locked_memory_is_released_when_the_last_view_dies():
    h = AsyncIOHandle()
    t = h.new_cpu_locked_tensor(1000, torch.empty(0))
    view = t[10:20]
    owner = h._locked[t.data_ptr()]
    alive = weakref.ref(owner)
    h.free_cpu_locked_tensor(t)
    del t, owner
    gc.collect()
    assert alive() is not None, "memory freed while a view is alive"
    view.fill_(3.0)
    del view
    gc.collect()
    assert alive() is None
    h.close()


def test_file_offsets_place_bytes_where_asked(tmp_path, handle):
    path = tmp_path / "offsets.bin"
    a, b, c = random_tensor(4096, torch.uint8, 1), random_tensor(1000, torch.uint8, 2), random_tensor(3, torch.int32, 3)
    handle.sync_pwrite(a, path)
    handle.sync_pwrite(b, path, file_offset=4096)   # aligned offset
    handle.sync_pwrite(c, path, file_offset=5101)   # unaligned: buffered
    data = path.read_bytes()
    assert data[:4096] == tensor_bytes(a) and data[4096:5096] == tensor_bytes(b) and data[5101:5113] == tensor_bytes(c)
    got = torch.empty(1000, dtype=torch.uint8)
    handle.sync_pread(got, path, file_offset=4096)
    assert tensor_bytes(got) == data[4096:5096]
    # a write at offset 0 makes the file exactly the tensor's size; other offsets never truncate
    handle.sync_pwrite(b, path)
    assert path.read_bytes() == tensor_bytes(b)


def test_async_ops_complete_on_wait_and_count(tmp_path, handle):
    tensors = [random_tensor(n, torch.float32, n) for n in (10, 5000, 70_001)]
    for k, t in enumerate(tensors):
        handle.async_pwrite(t, tmp_path / f"{k}.bin")
    assert handle.pending() >= 1
    assert handle.wait() == 3
    outs = [torch.empty_like(t) for t in tensors]
    for k, u in enumerate(outs):
        handle.pread(u, tmp_path / f"{k}.bin", async_op=True)
    assert handle.wait() == 3
    for t, u in zip(tensors, outs, strict=True):
        assert tensor_bytes(t) == tensor_bytes(u)  # random bytes hold NaNs: compare bytes


def test_async_tensor_stays_alive_until_wait(tmp_path, handle):
    t = random_tensor(200_000, torch.float32)
    expected = tensor_bytes(t)
    alive = weakref.ref(t)
    handle.async_pwrite(t, tmp_path / "dropped.bin")
    del t
    gc.collect()
    assert alive() is not None, "the tensor of a pending write was freed"
    assert handle.wait() == 1
    gc.collect()
    assert alive() is None
    assert (tmp_path / "dropped.bin").read_bytes() == expected


def test_validate_and_read_write_conveniences(tmp_path, handle):
    t = random_tensor(12_345, torch.int16)
    handle.write(t, tmp_path / "v.bin", validate=True)
    u = torch.empty_like(t)
    handle.read(u, tmp_path / "v.bin", validate=True)
    assert torch.equal(t, u)
    handle.pwrite(t, tmp_path / "w.bin", validate=True, async_op=True)
    assert handle.wait() == 1


def test_getters_report_the_settings():
    with ds_io.aio_handle(block_size=65536, queue_depth=16, single_submit=True, overlap_events=True,
                          intra_op_parallelism=2) as h:
        assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
                h.get_intra_op_parallelism()) == (65536, 16, True, True, 2)
        assert h.uses_libaio() == ds_io.AsyncIOBuilder().load().have_libaio()


BLOCK, DEPTH, THREADS = "[512, 268435456]", "[1, 65536]", "[1, 256]"


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 0}, f"block_size must be an integer in {BLOCK}, got 0"),
    ({"block_size": 2**40}, f"block_size must be an integer in {BLOCK}, got 1099511627776"),
    ({"block_size": 511}, f"block_size must be an integer in {BLOCK}, got 511"),
    ({"queue_depth": -1}, f"queue_depth must be an integer in {DEPTH}, got -1"),
    ({"queue_depth": 10**12}, f"queue_depth must be an integer in {DEPTH}, got 1000000000000"),
    ({"queue_depth": 65537}, f"queue_depth must be an integer in {DEPTH}, got 65537"),
    ({"intra_op_parallelism": 1.5}, f"intra_op_parallelism must be an integer in {THREADS}, got 1.5"),
    ({"intra_op_parallelism": 100000}, f"intra_op_parallelism must be an integer in {THREADS}, got 100000"),
    ({"intra_op_parallelism": True}, f"intra_op_parallelism must be an integer in {THREADS}, got True"),
    ({"single_submit": "yes"}, "single_submit must be True or False, got 'yes'"),
    ({"buffered_reads": 1}, "buffered_reads must be True or False, got 1"),
])
def test_bad_settings_name_the_value_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", "\\[").replace("]", "\\]")):
        AsyncIOHandle(**kwargs)


def test_the_limits_are_the_native_cores():
    assert _core().LIMITS == _limits.RANGES
    assert _limits.RANGES["queue_depth"] == (_limits.QUEUE_DEPTH_MIN, _limits.QUEUE_DEPTH_MAX)
    for name, (low, high) in _limits.RANGES.items():  # the bounds themselves are allowed
        assert _limits.check_range(name, low) == low and _limits.check_range(name, high) == high


@pytest.mark.parametrize("args, message", [
    ((1 << 20, 8, 100000), f"intra_op_parallelism must be an integer in {THREADS}, got 100000"),
    ((1 << 20, 10**12, 1), f"queue_depth must be an integer in {DEPTH}, got 1000000000000"),
    ((2**40, 8, 1), f"block_size must be an integer in {BLOCK}, got 1099511627776"),
])
def test_the_native_core_refuses_bad_values_itself_without_aborting(args, message):
    # Past the Python checks, straight into C++: once aborted (intra_op_parallelism), failed in
    # pybind (queue_depth), or bad_alloc (block_size). In a subprocess, so an abort shows as one.
    block_size, queue_depth, threads = args
    code = textwrap.dedent(f"""
        from ds_io.handle import _core
        try:
            _core().AioHandle({block_size}, {queue_depth}, False, False, {threads}, True)
        except ValueError as e:
            print("ValueError:", e)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"ValueError: {message}"


def test_python_handle_with_100000_threads_does_not_abort():
    code = "import ds_io\ntry:\n    ds_io.aio_handle(intra_op_parallelism=100000)\nexcept ValueError as e:\n    print(e)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, f"intra_op_parallelism must be an integer in {THREADS}, "
                                                          "got 100000"), done.stderr


def test_threads_that_cannot_start_raise_instead_of_aborting():
    # 256 threads need 2 GiB of stacks; an address-space limit makes thread creation fail midway.
    code = textwrap.dedent("""
        import resource, threading
        from ds_io.handle import _core
        core = _core()
        threading.stack_size(0)
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), resource.RLIM_INFINITY))
        try:
            core.AioHandle(1 << 20, 8, False, False, 256, False)
            print("started")
        except RuntimeError as e:
            print("RuntimeError:", e)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("RuntimeError: cannot start 256 worker threads (intra_op_parallelism; "), done.stdout
    assert "use fewer threads" in done.stdout


# ---- errors --------------------------------------------------------------------------------------
def test_wait_with_nothing_pending(handle):
    with pytest.raises(ValueError, match="wait\\(\\) called with no asynchronous operation pending"):
        handle.wait()


def test_missing_file_names_path_offset_and_size(tmp_path, handle):
    missing = tmp_path / "nope.bin"
    with pytest.raises(OSError, match=f"cannot open '{missing}' to read 400 bytes at offset 8: No such file"):
        handle.sync_pread(torch.empty(100, dtype=torch.float32), missing, file_offset=8)


def test_missing_directory_on_write(tmp_path, handle):
    target = tmp_path / "no_dir" / "x.bin"
    with pytest.raises(FileNotFoundError, match=f"cannot write 40 bytes to '{target}' at offset 0: directory"):
        handle.sync_pwrite(torch.zeros(10), target)


def test_short_file(tmp_path, handle):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 1000)
    with pytest.raises(OSError, match=f"'{path}' is 1000 bytes, too short to read 4000 bytes at offset 0"):
        handle.sync_pread(torch.empty(1000, dtype=torch.float32), path)
    handle.async_pread(torch.empty(10, dtype=torch.float32), path, file_offset=500)
    assert handle.wait() == 1
    with pytest.raises(OSError, match="too short to read 4000 bytes at offset 4"):
        handle.async_pread(torch.empty(1000, dtype=torch.float32), path, file_offset=4)


def test_read_only_path(tmp_path, handle):
    if os.geteuid() == 0:  # root writes through file modes: use a filesystem that refuses creation
        target = "/sys/ds_io_test.bin"
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        target = str(ro / "x.bin")
    with pytest.raises(OSError, match=f"cannot open '{target}' to write 32 bytes at offset 0: Permission denied"):
        handle.sync_pwrite(torch.zeros(8), target)


def test_failed_async_write_is_reported_by_wait(tmp_path, handle):
    # /proc/version opens for writing (as root) but refuses the write itself: the error arrives at wait()
    if os.geteuid() != 0:
        pytest.skip("needs root to open /proc/version for writing")
    handle.async_pwrite(torch.zeros(8), "/proc/version")
    with pytest.raises(OSError, match="1 of 1 operations failed: write of 32 bytes to '/proc/version' at file offset 0"):
        handle.wait()


def test_close_finishes_queued_request_operations(tmp_path):
    # the swapper's operations are not counted by wait(); close() must still let them finish
    code = textwrap.dedent(f"""
        import os, torch
        from ds_io import AsyncIOHandle
        h = AsyncIOHandle(intra_op_parallelism=1)
        tensors = [torch.full((1 << 18,), float(k)) for k in range(40)]
        ops = [h._start(True, t, os.path.join({str(tmp_path)!r}, str(k))) for k, t in enumerate(tensors)]
        h.close()
        print(all(op.done() for op in ops))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr
    assert all((tmp_path / str(k)).read_bytes() == tensor_bytes(torch.full((1 << 18,), float(k))) for k in range(40))


def test_closed_handle(tmp_path):
    h = AsyncIOHandle()
    h.async_pwrite(torch.ones(10), tmp_path / "c.bin")
    h.close()  # finishes the pending write first
    assert (tmp_path / "c.bin").read_bytes() == tensor_bytes(torch.ones(10))
    for call in (lambda: h.sync_pread(torch.ones(10), tmp_path / "c.bin"), h.wait,
                 lambda: h.new_cpu_locked_tensor(4, torch.ones(1))):
        with pytest.raises(ValueError, match="this aio handle is closed"):
            call()


def test_non_contiguous_and_non_tensor(tmp_path, handle):
    t = torch.zeros(8, 8).t()
    with pytest.raises(ValueError, match=r"must be contiguous, got shape \(8, 8\) with strides \(1, 8\)"):
        handle.sync_pwrite(t, tmp_path / "nc.bin")
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor, got bytes"):
        handle.sync_pwrite(b"abc", tmp_path / "nc.bin")
    with pytest.raises(ValueError, match="file_offset must be an integer >= 0, got -4"):
        handle.sync_pwrite(torch.zeros(2), tmp_path / "nc.bin", file_offset=-4)


def test_fallbacks_are_logged(tmp_path, handle, caplog):
    with caplog.at_level(logging.INFO, logger="ds_io.handle"):
        handle.sync_pwrite(torch.zeros(3000), tmp_path / "f.bin", file_offset=12)
        handle.sync_pwrite(torch.zeros(3000), tmp_path / "g.bin")
    text = caplog.text
    assert "file offset 12 is not a multiple of 4096: buffered I/O instead of O_DIRECT" in text
    assert "size 12000 is not a multiple of 4096: the last 3808 bytes go through buffered I/O" in text


def test_gds(tmp_path):
    if ds_io.gds_available():
        pytest.skip("GPUDirect Storage is present here")
    with pytest.raises(RuntimeError, match=r"gds_handle requires GPUDirect Storage \(NVIDIA GPU \+ cuFile\), but"):
        ds_io.gds_handle()


def test_gds_device_pinning_raises_instead_of_pretending(monkeypatch, caplog):
    import ds_io.handle as handle_module
    monkeypatch.setattr(handle_module, "_gds_missing", lambda: "")  # as where GPUDirect Storage is present
    with caplog.at_level(logging.WARNING, logger="ds_io.handle"), ds_io.gds_handle() as h:
        assert "cuFile is not driven yet" in caplog.text
        t = torch.empty(16)
        for call in (lambda: h.new_pinned_device_tensor(16, t), lambda: h.free_pinned_device_tensor(t),
                     lambda: h.pin_device_tensor(t), lambda: h.unpin_device_tensor(t)):
            with pytest.raises(RuntimeError, match=r"requires GPUDirect Storage \(NVIDIA GPU \+ cuFile\)"):
                call()


# ---- DeepSpeed's calling conventions ----------------------------------------------------------------
def test_return_values_are_deepspeeds(tmp_path, handle):
    t = random_tensor(8192, torch.uint8)
    u = torch.empty_like(t)
    path = tmp_path / "ds.bin"
    assert handle.sync_pwrite(t, path) == 1
    assert handle.sync_pread(u, path) == 1
    assert handle.pwrite(t, path, False, False) == 1
    assert handle.pread(u, path, False, False) == 1
    assert handle.write(t, path, False) == 1
    assert handle.read(u, path, True) == 1
    assert handle.async_pwrite(t, path) == 0
    assert handle.wait() == 1
    assert handle.async_pread(u, path) == 0
    assert handle.pread(u, path, False, True, 0) == 0
    assert handle.wait() == 2
    assert tensor_bytes(u) == tensor_bytes(t)


def test_deepspeeds_keywords_are_accepted(tmp_path, handle):
    t = random_tensor(5000, torch.int16)
    u = torch.empty_like(t)
    path = tmp_path / "kw.bin"
    assert handle.sync_pwrite(buffer=t, filename=path) == 1
    assert handle.sync_pread(buffer=u, filename=str(path), file_offset=0) == 1
    assert handle.async_pwrite(buffer=t, filename=path, file_offset=4096) == 0
    assert handle.wait() == 1
    assert handle.pread(buffer=u, filename=path, validate=True, async_op=False, file_offset=4096) == 1
    assert handle.write(buffer=t, filename=path, validate=True) == 1
    assert handle.read(buffer=u, filename=path, validate=False, file_offset=0) == 1
    assert tensor_bytes(u) == tensor_bytes(t) == path.read_bytes()


@pytest.mark.parametrize("threads", [1, 3])
def test_buffered_reads_with_readahead(tmp_path, threads):
    data = random_tensor(3 * (1 << 20) + 4096 * 7 + 5, torch.uint8, 9)  # unaligned size, several pieces
    path = tmp_path / "b.bin"
    path.write_bytes(tensor_bytes(data))
    with AsyncIOHandle(block_size=65536, queue_depth=4, intra_op_parallelism=threads, buffered_reads=True) as h:
        assert h.uses_buffered_reads()
        u = h.new_cpu_locked_tensor(data.numel(), data)
        assert h.sync_pread(u, path) == 1
        assert tensor_bytes(u) == tensor_bytes(data)
        part = torch.empty(200_000, dtype=torch.uint8)
        assert h.async_pread(part, path, file_offset=12_345) == 0 and h.wait() == 1
        assert tensor_bytes(part) == tensor_bytes(data[12_345:212_345])
        h.sync_pwrite(data[:8192].clone(), tmp_path / "w.bin")  # writes are unaffected
        assert (tmp_path / "w.bin").read_bytes() == tensor_bytes(data[:8192])
    assert not AsyncIOHandle().uses_buffered_reads()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensor_roundtrip(tmp_path, handle):
    t = random_tensor(100_001, torch.float16).cuda()
    handle.sync_pwrite(t, tmp_path / "gpu.bin")
    assert (tmp_path / "gpu.bin").read_bytes() == tensor_bytes(t.cpu())
    u = torch.empty_like(t)
    handle.async_pread(u, tmp_path / "gpu.bin")
    assert handle.wait() == 1
    assert tensor_bytes(t.cpu()) == tensor_bytes(u.cpu())


def test_locked_tensors_and_bounce_buffers_come_from_the_accelerator_seam(monkeypatch, tmp_path):
    """On a GPU the page-locked buffers are the seam's pinned memory: here a stand-in accelerator
    that says it is not synchronous (as CUDA) hands them out, and the handle uses and frees them."""
    from ds_io import handle as handle_module

    made = []

    class Gpu:
        def is_synchronized_device(self):
            return False

        def pinned_empty(self, size, dtype):
            made.append((tuple(size) if isinstance(size, (tuple, torch.Size)) else (size,), dtype))
            return torch.empty(size, dtype=dtype)

    monkeypatch.setattr(handle_module, "get_accelerator", Gpu)
    with AsyncIOHandle() as h:
        t = h.new_cpu_locked_tensor(1000, torch.zeros(1, dtype=torch.bfloat16))
        assert made == [((1000,), torch.bfloat16)] and t.dtype == torch.bfloat16 and t.numel() == 1000
        assert h.free_cpu_locked_tensor(t) and not h.free_cpu_locked_tensor(t)
    monkeypatch.setattr(handle_module, "get_accelerator", lambda: ds_ops.get_accelerator())
    with AsyncIOHandle() as h:  # the real seam on this machine
        t = h.new_cpu_locked_tensor(4096, torch.zeros(1))
        assert t.is_pinned() == (ds_ops.get_accelerator().device_name() == "cuda")
        assert h.free_cpu_locked_tensor(t)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_locked_tensors_are_pinned_and_feed_the_gpu(tmp_path, handle):
    locked = handle.new_cpu_locked_tensor(1 << 20, torch.zeros(1))
    assert locked.is_pinned() and ds_ops.get_accelerator().is_pinned(locked)
    locked.copy_(torch.arange(1 << 20, dtype=torch.float32))
    handle.sync_pwrite(locked, tmp_path / "pinned.bin")
    back = torch.empty(1 << 20, device="cuda")
    handle.sync_pread(back, tmp_path / "pinned.bin")
    assert torch.equal(back.cpu(), locked)
    assert handle.free_cpu_locked_tensor(locked)
