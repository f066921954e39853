"""TensorSwapper: thousands of odd-sized tensors out and back, compared byte for byte with the
originals; byte ranges inside keys against a bytearray model of the file; requests that return at
once and finish on their own; failed writes leave the old file under the final name."""

from __future__ import annotations

import gc
import os
import resource
import signal
import weakref

import pytest
import torch

from ds_io import AioConfig, AsyncIOHandle, SwapRequest, TensorSwapper

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.bool, torch.int16]


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def make_tensors(count: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 1500, (count,), generator=g).tolist()
    sizes[:4] = [0, 1, 4096, 70_001]  # empty, one element, aligned, several block_size pieces
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
    with TensorSwapper(tmp_path / "swap", config) as swapper:
        request = swapper.swap_out(tensors, keys=keys)
        assert isinstance(request, SwapRequest)
        assert request.wait() == tensors and request.done()
        for key, t in zip(keys[:50], tensors[:50], strict=True):  # the files hold exactly the bytes
            assert swapper.path_of(key).read_bytes() == tensor_bytes(t)
        back = swapper.swap_in(keys).wait()
        for t, u in zip(tensors, back, strict=True):
            assert u.dtype == t.dtype and u.shape == t.shape and tensor_bytes(u) == tensor_bytes(t)
            assert u.numel() == 0 or u.data_ptr() % 4096 == 0  # its own allocations are O_DIRECT-ready
        # into given tensors, in another order, many requests in flight at once
        order = list(reversed(range(len(keys))))
        outs = [torch.empty_like(tensors[k]) for k in order]
        requests = [swapper.swap_in([keys[k]], out=[u]) for k, u in zip(order, outs, strict=True)]
        for r in reversed(requests):  # waited in any order
            r.wait()
        for k, u in zip(order, outs, strict=True):
            assert tensor_bytes(u) == tensor_bytes(tensors[k])
        swapper.release(keys)
        assert swapper.keys() == [] and list((tmp_path / "swap").iterdir()) == []


def test_byte_ranges_inside_a_key(tmp_path):
    size = 64 * 1024
    model = bytearray(tensor_bytes(random_bytes(size, 1)))  # what the file must hold
    with TensorSwapper(tmp_path, {"block_size": 8192, "thread_count": 2}) as swapper:
        swapper.swap_out([torch.frombuffer(bytearray(model), dtype=torch.uint8)], keys=["k"]).wait()
        a, b = random_bytes(8192, 2), random_bytes(100, 3).view(torch.int8)
        requests = [swapper.swap_out([a], keys=["k"], offset=4096),   # aligned: O_DIRECT
                    swapper.swap_out([b], keys=["k"], offset=20_001)]  # unaligned: buffered
        model[4096:4096 + 8192] = tensor_bytes(a)
        model[20_001:20_101] = tensor_bytes(b)
        for r in requests:
            r.wait()
        assert swapper.path_of("k").read_bytes() == bytes(model)  # size unchanged, rest untouched
        parts = [torch.empty(5000, dtype=torch.uint8), torch.empty(3, dtype=torch.float32)]
        got = [swapper.swap_in(["k"], out=[parts[0]], offset=4000), swapper.swap_in(["k"], out=[parts[1]], offset=size - 12)]
        assert [r.wait()[0] for r in got] == parts
        assert tensor_bytes(parts[0]) == bytes(model[4000:9000])
        assert tensor_bytes(parts[1]) == bytes(model[size - 12:])
        whole = swapper.swap_in(["k"]).wait()[0]
        assert whole.shape == (size,) and tensor_bytes(whole) == bytes(model)
        # one offset per key
        swapper.swap_out([torch.arange(4, dtype=torch.int32)], keys=["j"]).wait()
        pair = [torch.empty(4, dtype=torch.uint8), torch.empty(2, dtype=torch.uint8)]
        swapper.swap_in(["k", "j"], out=pair, offset=[0, 4]).wait()
        assert tensor_bytes(pair[0]) == bytes(model[:4]) and tensor_bytes(pair[1]) == bytes([1, 0])
        with pytest.raises(ValueError, match=r"key 'k' holds 65536 bytes; 8 bytes at offset 65532 do not fit"):
            swapper.swap_out([torch.zeros(8, dtype=torch.uint8)], keys=["k"], offset=size - 4)
        with pytest.raises(ValueError, match="reading at an offset needs out="):
            swapper.swap_in(["k"], offset=0)
        with pytest.raises(KeyError, match="swap_out: unknown key 'new'"):
            swapper.swap_out([a], keys=["new"], offset=0)
        with pytest.raises(ValueError, match="offset must be None \\(the whole key\\) or a byte offset >= 0, got -1"):
            swapper.swap_in(["k"], out=[a], offset=-1)
        with pytest.raises(ValueError, match="2 keys but 1 offsets"):
            swapper.swap_in(["k", "j"], out=pair, offset=[0])


class GatedHandle:
    """The swapper's handle with every operation held back until ``release()``: what was started,
    from which memory, and proof that no call waits for I/O."""

    def __init__(self, handle: AsyncIOHandle):
        self.handle = handle
        self.pending: list[GatedOp] = []
        self.tensors: list[torch.Tensor] = []

    def _start(self, write, tensor, path, offset=0, rename_to=None, keep_size=False):
        self.tensors.append(tensor)
        op = GatedOp((write, tensor, path, offset, rename_to, keep_size))
        self.pending.append(op)
        return op

    def release(self):
        for op in self.pending:
            write, tensor, path, offset, rename_to, keep_size = op.args
            op.real = self.handle._start(write, tensor, path, offset, rename_to=rename_to, keep_size=keep_size)
        self.pending = []

    def _log_notes(self):
        self.handle._log_notes()

    def close(self):
        self.handle.close()


class GatedOp:
    def __init__(self, args):
        self.args, self.real = args, None

    def done(self):
        return self.real is not None and self.real.done()

    def wait(self):
        assert self.real is not None, "waited for an operation the test has not let start"
        self.real.wait()


@pytest.fixture()
def gated(tmp_path):
    swapper = TensorSwapper(tmp_path, {"block_size": 8192})
    gate = GatedHandle(swapper._handle)
    swapper._handle = gate
    yield swapper, gate
    gate.release()
    swapper.close()


def test_calls_return_at_once_from_the_callers_memory_and_each_request_waits_alone(gated):
    swapper, gate = gated
    big = [random_bytes(1 << 20, k) for k in range(40)]  # 40 MiB: more than any staging buffers held
    out = swapper.swap_out(big, keys=[f"b{k}" for k in range(40)])
    assert not out.done() and len(gate.pending) == 40  # all 40 queued, none waited for
    # no staging copy: the I/O goes from the caller's own memory
    assert [t.data_ptr() for t in gate.tensors] == [t.data_ptr() for t in big]
    small = swapper.swap_out([torch.ones(3)], keys=["s"])
    assert swapper.keys() == []  # nothing is a key before its write is done
    gate.release()
    small.wait()
    assert swapper.keys() == ["s"]  # finished on its own, though the 40 MiB may still be in flight
    out.wait()
    assert sorted(swapper.keys()) == sorted(["s", *(f"b{k}" for k in range(40))])
    buffers = [torch.empty(1 << 20, dtype=torch.uint8) for _ in range(3)]
    reads = swapper.swap_in(["b0", "b1", "b2"], out=buffers)
    assert [t.data_ptr() for t in gate.tensors[-3:]] == [t.data_ptr() for t in buffers]
    gate.release()
    assert reads.wait() == buffers
    assert all(tensor_bytes(u) == tensor_bytes(t) for u, t in zip(buffers, big[:3], strict=True))


def test_queued_requests_hold_no_file_descriptors(tmp_path):
    tensors = [random_bytes(256 * 1024, k) for k in range(200)]
    with TensorSwapper(tmp_path, {"block_size": 65536, "thread_count": 1}) as swapper:
        before = len(os.listdir("/proc/self/fd"))
        requests = [swapper.swap_out([t], keys=[k]) for k, t in enumerate(tensors)]
        in_flight = len(os.listdir("/proc/self/fd")) - before
        assert in_flight <= 4, f"{in_flight} file descriptors open for queued requests"
        for r in requests:
            r.wait()
        assert all(swapper.path_of(k).read_bytes() == tensor_bytes(t) for k, t in enumerate(tensors))


def test_tensors_stay_alive_until_the_request_is_done(gated):
    swapper, gate = gated
    t = random_bytes(100_000, 5)
    expected = tensor_bytes(t)
    alive = weakref.ref(t)
    swapper.swap_out([t], keys=["t"])  # the request object itself is dropped too
    del t
    gc.collect()
    assert alive() is not None, "the tensor of an unfinished write was freed"
    gate.release()
    swapper.wait()
    gate.tensors.clear()  # the test's own record
    gc.collect()
    assert alive() is None
    assert swapper.path_of("t").read_bytes() == expected


def test_a_finished_requests_tensors_are_freed_without_the_garbage_collector(tmp_path):
    """No reference cycle keeps a waited request (and the tensors it read into) alive until the next
    gc run: ZeRO-Infinity reads gigabytes of shards per step into fresh tensors."""
    with TensorSwapper(tmp_path) as swapper:
        swapper.swap_out([random_bytes(100_000, 6)], keys=["k"]).wait()
        gc.disable()
        try:
            request = swapper.swap_in(["k"])
            alive = [weakref.ref(request), weakref.ref(request.wait()[0])]
            request = None
            assert [ref() for ref in alive] == [None, None]
        finally:
            gc.enable()


def test_conflicting_requests_are_refused_until_waited(gated):
    swapper, gate = gated
    swapper.swap_out([random_bytes(16384, 1)], keys=["k"])
    gate.release()
    swapper.wait()
    whole = swapper.swap_out([random_bytes(16384, 2)], keys=["k"])
    with pytest.raises(ValueError, match="swap_in: key 'k' is still being written by a swap_out request"):
        swapper.swap_in(["k"])
    with pytest.raises(ValueError, match="key 'k' is still being written"):
        swapper.swap_out([random_bytes(10, 3)], keys=["k"], offset=0)
    gate.release()
    whole.wait()
    part = swapper.swap_out([random_bytes(4096, 4)], keys=["k"], offset=4096)
    swapper.swap_out([random_bytes(4096, 5)], keys=["k"], offset=8192)  # disjoint: allowed
    swapper.swap_in(["k"], out=[torch.empty(4096, dtype=torch.uint8)], offset=0)  # disjoint read: allowed
    with pytest.raises(ValueError, match=r"key 'k': bytes \[6000, 6100\) are being written by an unfinished "
                                         r"request \(bytes \[4096, 8192\)\)"):
        swapper.swap_in(["k"], out=[torch.empty(100, dtype=torch.uint8)], offset=6000)
    with pytest.raises(ValueError, match=r"bytes \[0, 16384\) are being written"):
        swapper.swap_out([random_bytes(16384, 6)], keys=["k"])
    with pytest.raises(ValueError, match="release: key 'k' is in use by an unfinished request"):
        swapper.release(["k"])
    gate.release()
    part.wait()
    swapper.wait()
    swapper.release(["k"])


def test_a_whole_write_may_replace_a_key_being_read(gated):
    swapper, gate = gated
    old, new = random_bytes(8192, 1), random_bytes(8192, 2)
    swapper.swap_out([old], keys=["k"])
    gate.release()
    swapper.wait()
    into = torch.empty(8192, dtype=torch.uint8)
    read = swapper.swap_in(["k"], out=[into])
    gate.release()  # the read opens the file now, before the new version is renamed over it
    write = swapper.swap_out([new], keys=["k"])
    gate.release()
    read.wait()
    write.wait()
    assert tensor_bytes(into) == tensor_bytes(old)
    again = swapper.swap_in(["k"])
    gate.release()
    assert tensor_bytes(again.wait()[0]) == tensor_bytes(new)


def test_rewrites_reuse_the_previous_versions_file(tmp_path):
    # a whole write exchanges the old version to the temporary name and the next one writes into
    # it: no blocks freed (trimmed, with online discard) and allocated anew on every swap_out
    with TensorSwapper(tmp_path, {"block_size": 65536}) as swapper:
        inodes = []
        for k in range(4):
            swapper.swap_out([random_bytes(100_000 - 1000 * k, k)], keys=["k"]).wait()
            inodes.append(os.stat(swapper.path_of("k")).st_ino)
            assert tensor_bytes(swapper.swap_in(["k"]).wait()[0]) == tensor_bytes(random_bytes(100_000 - 1000 * k, k))
        assert inodes[2] == inodes[0] and inodes[3] == inodes[1] != inodes[0]
        assert len(os.listdir(tmp_path)) == 2  # the key and its spare
        swapper.swap_out([random_bytes(10, 9)], keys=["j"]).wait()
        swapper.swap_out([random_bytes(10, 8)], keys=["j"]).wait()
        swapper.release(["k"])
        assert len(os.listdir(tmp_path)) == 2  # j and its spare: k's spare went with it
    assert os.listdir(tmp_path) == [swapper.path_of("j").name]  # close removes the spares


def test_a_rewrite_never_writes_into_a_file_an_unfinished_read_may_hold(gated):
    swapper, gate = gated
    for k in range(2):
        swapper.swap_out([random_bytes(8192, k)], keys=["k"])
        gate.release()
        swapper.wait()
    spare = {p.name for p in swapper.path_of("k").parent.iterdir()} - {swapper.path_of("k").name}
    assert len(spare) == 1
    read = swapper.swap_in(["k"])
    write = swapper.swap_out([random_bytes(8192, 2)], keys=["k"])
    assert os.path.basename(gate.pending[-1].args[2]) not in spare  # a fresh name, not the spare
    gate.release()
    assert tensor_bytes(read.wait()[0]) == tensor_bytes(random_bytes(8192, 1))
    write.wait()
    assert {p.name for p in swapper.path_of("k").parent.iterdir()} - {swapper.path_of("k").name} == spare
    swapper.swap_out([random_bytes(8192, 3)], keys=["k"])
    assert os.path.basename(gate.pending[-1].args[2]) in spare  # nothing reads: the spare again
    gate.release()
    swapper.wait()
    again = swapper.swap_in(["k"])
    gate.release()
    assert tensor_bytes(again.wait()[0]) == tensor_bytes(random_bytes(8192, 3))


def test_failed_write_keeps_the_old_file(tmp_path):
    old = torch.arange(1000, dtype=torch.float32)
    with TensorSwapper(tmp_path, {"block_size": 65536}) as swapper:
        swapper.swap_out([old], keys=["w"]).wait()
        previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (131_072, hard))  # a "full disk" at 128 KiB
        try:
            request = swapper.swap_out([torch.ones(200_000)], keys=["w"])
            with pytest.raises(OSError, match=r"File too large.*key 'w' was not swapped out"):
                request.wait()
            with pytest.raises(OSError, match="key 'w' was not swapped out"):
                request.wait()  # again: the same answer
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, previous_handler)
        swapper.wait()  # already reported by the request: not raised twice
        assert tensor_bytes(swapper.swap_in(["w"]).wait()[0]) == tensor_bytes(old)
        assert [p.name for p in tmp_path.iterdir()] == [swapper.path_of("w").name]  # no temp file left


def test_unwaited_failures_surface_in_the_swappers_wait(tmp_path):
    with TensorSwapper(tmp_path / "s", {"block_size": 8192}) as swapper:
        swapper.swap_out([torch.ones(10)], keys=["a"]).wait()
        os.rename(swapper.path_of("a"), tmp_path / "moved")  # the file vanishes behind the swapper's back
        swapper.swap_in(["a"])  # the request is dropped unwaited
        with pytest.raises(OSError, match=r"swapper: key 'a': cannot open .* No such file"):  # at its turn
            swapper.wait()
        swapper.wait()  # reported once


def test_errors_name_the_key(tmp_path):
    with TensorSwapper(tmp_path) as swapper:
        with pytest.raises(KeyError, match="swap_in: unknown key 'nope' \\(0 keys are swapped out\\)"):
            swapper.swap_in(["nope"])
        with pytest.raises(ValueError, match="swap_out: 2 tensors but 1 keys"):
            swapper.swap_out([torch.ones(1), torch.ones(1)], keys=["a"])
        with pytest.raises(TypeError, match="takes 2 positional arguments"):
            swapper.swap_out([torch.ones(1)], ["a"])  # keys are keyword-only
        with pytest.raises(ValueError, match=r"key 'nc': the tensor must be contiguous"):
            swapper.swap_out([torch.zeros(4, 4).t()], keys=["nc"])
        swapper.swap_out([torch.ones(4)], keys=["a"]).wait()
        with pytest.raises(ValueError, match="swap_in: key 'a' holds 16 bytes"):
            swapper.swap_in(["a"], out=[torch.empty(3)])
        with pytest.raises(ValueError, match="swap_in: the keys repeat"):
            swapper.swap_in(["a", "a"])
        swapper.release(["a"])
        with pytest.raises(KeyError, match="release: unknown key 'a'"):
            swapper.release(["a"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_are_refused_with_the_way_out(tmp_path):
    with TensorSwapper(tmp_path) as swapper, pytest.raises(ValueError, match="copy to a page-locked CPU buffer"):
        swapper.swap_out([torch.ones(4, device="cuda")], keys=["g"])


def test_swap_dir_is_created_and_use_gds_is_checked(tmp_path):
    TensorSwapper(tmp_path / "a" / "b", {"thread_count": 1}).close()
    assert (tmp_path / "a" / "b").is_dir()
    from ds_io import gds_available
    if not gds_available():
        with pytest.raises(RuntimeError, match=r"aio\.use_gds is true, but NVIDIA GPUDirect Storage is not available"):
            TensorSwapper(tmp_path, {"use_gds": True})
    assert os.listdir(tmp_path) == ["a"]


def test_allocate_makes_a_key_filled_piece_by_piece(tmp_path):
    """A key larger than any tensor in memory: reserved, then written at offsets (the first piece at
    offset 0 too: in place, the file keeps its size), read back whole and in pieces."""
    n, piece = 3 * 4096 + 10, 4096
    values = torch.arange(n, dtype=torch.float32)
    with TensorSwapper(tmp_path, {"block_size": 8192}) as swapper:
        swapper.allocate("big", (n,), torch.float32)
        assert swapper.path_of("big").stat().st_size == 4 * n
        assert torch.equal(swapper.swap_in(["big"]).wait()[0], torch.zeros(n))  # not written: zeros
        for start in range(0, n, piece):
            swapper.swap_out([values[start:start + piece].clone()], keys=["big"], offset=4 * start).wait()
            assert swapper.path_of("big").stat().st_size == 4 * n
        assert torch.equal(swapper.swap_in(["big"]).wait()[0], values)
        part = torch.empty(100)
        swapper.swap_in(["big"], out=[part], offset=4 * 5000).wait()
        assert torch.equal(part, values[5000:5100])
        with pytest.raises(ValueError, match="allocate: key 'big' exists already"):
            swapper.allocate("big", (1,), torch.float32)
        swapper.release(["big"])
        assert not any(tmp_path.iterdir())


def test_allocate_on_a_full_disk_names_the_bytes_and_the_path(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with TensorSwapper(tmp_path) as swapper:
        with pytest.raises(OSError, match=r"cannot reserve 400 bytes for key 'k' in '.*': No space left on device"):
            swapper.allocate("k", (100,), torch.float32)
        assert not any(tmp_path.iterdir()) and swapper.keys() == []
