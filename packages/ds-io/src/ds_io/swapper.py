"""`TensorSwapper`: tensors out to files and back, what ZeRO-Infinity offloads through.

    swapper = TensorSwapper("/nvme/swap", AioConfig())
    w = swapper.swap_out([p1, p2], keys=["sub0.fp32", "sub0.exp_avg"])  # returns at once
    r = swapper.swap_in(["sub1.fp32"], out=[buffer])                      # a prefetch, also at once
    ...                                                                  # compute meanwhile
    w.wait(); r.wait()                                                   # each request on its own
    swapper.swap_in(["sub0.fp32"], out=[half], offset=4096).wait()        # a byte range of a key
    swapper.release(["sub0.fp32", "sub0.exp_avg"])                        # their files are removed
    swapper.allocate("big", (n,), torch.float32)  # a key filled piece by piece with swap_out(offset=)

I/O goes straight from and into the caller's tensors (contiguous, on the CPU; page-locked ones
from ``aio_handle.new_cpu_locked_tensor`` or ``pin_memory`` are best): no staging copy, no
swapper-owned buffers. Every call returns a `SwapRequest` at once, with its own ``done()`` and
``wait()``; any number of requests may be in flight (they queue on the handle's worker threads,
in order), bounded only by the tensors the caller passes. The caller must not change a tensor
being written, nor read one being read into, before its request is done; the request keeps the
tensors alive until then.

O_DIRECT needs the memory address, the length and the file offset to be multiples of 4096 bytes
(the logical block size of most devices is 512 or 4096; ds-io uses 4096 for all three). When
the address is not aligned, the bytes go through a per-worker aligned buffer of one
``block_size`` piece (one memcpy, still O_DIRECT); when the length is not a multiple, its last
< 4096 bytes go through buffered I/O; when the offset is not aligned, that operation is
buffered. Each fallback is logged at INFO by ``ds_io.handle``; tensors that ``swap_in`` allocates
itself are aligned.

Crash safety: a whole-key write (``offset=None``) goes to a temporary name that is renamed into
place by the I/O thread once all its bytes are written, so a failed or interrupted write never
leaves a half-written file under the key's name (the previous contents, if any, stay). The
previous version is not deleted: it is exchanged to the temporary name (renameat2
RENAME_EXCHANGE) and the key's next whole write goes into it, overwriting blocks already
allocated. Deleting it and writing a new file instead frees and allocates the key's size on every
swap_out, and on a filesystem mounted with ``discard`` (online TRIM) every freed block is also
trimmed: the device did a discard as large as each write, which doubled the I/O time and made
overlapped I/O slower than blocking I/O (benchmarks/bench_swap_overlap.py). The cost: a key
written whole more than once takes twice its size on disk until ``release`` (or ``close``). A
write
at an ``offset`` updates the key's file in place: a failure or a crash can leave that byte range
partly written (the rest of the file is untouched); it never changes the file's size.

Not thread-safe: call a swapper from one thread.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import AioConfig
from .handle import AsyncIOHandle, gds_available

logger = logging.getLogger(__name__)

ALIGNMENT = 4096


@dataclass
class _Entry:
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    path: Path


@dataclass
class _Span:
    """A byte range of a key that an unfinished request reads or writes."""
    start: int
    end: int
    write: bool
    whole: bool  # a whole-key write (temp name + rename)
    request: SwapRequest


class SwapRequest:
    """One ``swap_out``/``swap_in`` call's transfers. ``done()`` polls, ``wait()`` blocks; both
    are cheap to call again. ``tensors`` are the request's tensors (for ``swap_in``, the ones that
    receive the data)."""

    def __init__(self, swapper: TensorSwapper, write: bool, keys: Sequence[Any], tensors: list[torch.Tensor]):
        self._swapper = swapper
        self._write = write
        self.keys = tuple(keys)
        self.tensors = tensors
        self._ops: list[tuple[Any, Any, Callable[[bool], None]]] = []  # key, native op, on_end(ok)
        self._errors: list[str] = []
        self._finished = False
        self._reported = False

    def done(self) -> bool:
        """True once every transfer of the request has ended (successfully or not); never blocks."""
        if not self._finished and all(op.done() for _, op, _ in self._ops):
            self._finish()
        return self._finished

    def wait(self) -> list[torch.Tensor]:
        """Block until the request's transfers end; returns ``tensors``. Raises ``OSError`` naming
        the keys whose transfers failed (a failed whole-key write leaves the key as it was)."""
        if not self._finished:
            for _, op, _ in self._ops:
                try:
                    op.wait()
                except OSError:
                    pass  # collected by _finish
            self._finish()
        if self._errors:
            self._reported = True
            raise OSError("swapper: " + "; ".join(self._errors))
        return self.tensors

    def __repr__(self) -> str:
        state = "failed" if self._finished and self._errors else "done" if self._finished else "in flight"
        return f"SwapRequest({'swap_out' if self._write else 'swap_in'} of {len(self.keys)} keys, {state})"

    def _finish(self) -> None:
        for key, op, on_end in self._ops:
            try:
                op.wait()  # returns at once: the op is done
                ok = True
            except OSError as e:
                ok = False
                self._errors.append(f"key {key!r}: {e}")
            on_end(ok)
        # the callbacks refer to this request (through their spans): dropping them breaks the cycle, so
        # the request and its tensors are freed when the caller lets go of it, not at the next gc run
        self._ops = []
        self._finished = True
        self._swapper._finished(self)


class TensorSwapper:
    """Swap tensors between memory and files in ``swap_dir`` (created if missing), through one
    aio handle configured by ``aio_config`` (an ``AioConfig`` or its dict)."""

    def __init__(self, swap_dir: str | os.PathLike, aio_config: AioConfig | dict | None = None):
        config = aio_config if isinstance(aio_config, AioConfig) else AioConfig.model_validate(aio_config or {})
        if config.use_gds and not gds_available():
            raise RuntimeError("aio.use_gds is true, but NVIDIA GPUDirect Storage is not available here "
                               "(see ds_io.gds_available()); set use_gds to false")
        self.swap_dir = Path(swap_dir)
        self.swap_dir.mkdir(parents=True, exist_ok=True)
        self.config = config
        self._handle = AsyncIOHandle(**config.handle_kwargs())
        self._entries: dict[Any, _Entry] = {}
        self._spans: dict[Any, list[_Span]] = {}
        self._requests: list[SwapRequest] = []  # not finished, or finished with errors nobody saw
        self._temp_count = 0

    # ---- public API ---------------------------------------------------------------------------------
    def swap_out(self, tensors: Sequence[torch.Tensor], *, keys: Sequence[Any],
                 offset: int | Sequence[int] | None = None) -> SwapRequest:
        """Start writing each tensor to its key's file and return at once.

        ``offset=None``: the tensor becomes the key's whole content (shape and dtype included),
        under a temporary name renamed into place when written. ``offset=N`` (bytes; one int or
        one per key): the tensor's bytes overwrite the existing key's file from byte N in place;
        they must fit inside it."""
        self._reap()
        tensors, keys = list(tensors), list(keys)
        if len(tensors) != len(keys):
            raise ValueError(f"swap_out: {len(tensors)} tensors but {len(keys)} keys; give one key per tensor")
        if len(set(map(_hashable, keys))) != len(keys):
            raise ValueError(f"swap_out: the keys repeat: {keys}")
        offsets = _offsets(offset, len(keys), "swap_out")
        plans = []
        for tensor, key, off in zip(tensors, keys, offsets, strict=True):
            nbytes = _check_tensor(tensor, key, "swap_out")
            if off is None:
                self._check_free(key, 0, nbytes, write=True, whole=True, what="swap_out")
            else:
                entry = self._entry(key, "swap_out")
                _check_range(key, entry, off, nbytes, "swap_out")
                self._check_free(key, off, off + nbytes, write=True, whole=False, what="swap_out")
            plans.append((tensor, key, off, nbytes))
        request = SwapRequest(self, True, keys, tensors)
        for tensor, key, off, nbytes in plans:
            if off is None:
                self._start_whole_write(request, tensor, key, nbytes)
            else:
                self._start(request, key, True, tensor, self._entries[key].path, off, nbytes, whole=False)
        return self._track(request)

    def swap_in(self, keys: Sequence[Any], *, out: Sequence[torch.Tensor] | None = None,
                offset: int | Sequence[int] | None = None) -> SwapRequest:
        """Start reading the keys and return at once; ``request.wait()`` returns the tensors.

        ``offset=None``: each key's whole content, into ``out`` (contiguous CPU tensors of as many
        bytes) or, without ``out``, into new 4096-aligned tensors of the key's shape and dtype.
        ``offset=N`` (bytes; one int or one per key): ``out[k].nbytes`` bytes of the key's file
        from byte N (``out`` is then required)."""
        self._reap()
        keys = list(keys)
        if len(set(map(_hashable, keys))) != len(keys):
            raise ValueError(f"swap_in: the keys repeat: {keys}")
        offsets = _offsets(offset, len(keys), "swap_in")
        entries = [self._entry(key, "swap_in") for key in keys]
        if out is None:
            if any(off is not None for off in offsets):
                raise ValueError("swap_in: reading at an offset needs out= (the tensors that receive the bytes)")
            out = [_aligned_empty(e.shape, e.dtype) for e in entries]
        else:
            out = list(out)
            if len(out) != len(keys):
                raise ValueError(f"swap_in: {len(keys)} keys but {len(out)} output tensors")
        spans = []
        for key, entry, tensor, off in zip(keys, entries, out, offsets, strict=True):
            nbytes = _check_tensor(tensor, key, "swap_in")
            if off is None and nbytes != entry.nbytes:
                raise ValueError(f"swap_in: key {key!r} holds {entry.nbytes} bytes ({entry.dtype}, shape "
                                 f"{entry.shape}); the output tensor must have as many bytes, got {nbytes} "
                                 f"bytes ({tensor.dtype}, shape {tuple(tensor.shape)}); or give offset=")
            start = 0 if off is None else off
            _check_range(key, entry, start, nbytes, "swap_in")
            self._check_free(key, start, start + nbytes, write=False, whole=False, what="swap_in")
            spans.append((key, entry, tensor, start, nbytes))
        request = SwapRequest(self, False, keys, out)
        for key, entry, tensor, start, nbytes in spans:
            self._start(request, key, False, tensor, entry.path, start, nbytes, whole=False)
        return self._track(request)

    def wait(self) -> None:
        """Wait for every request not finished yet; raises ``OSError`` naming the keys of failed
        transfers that no request's own ``wait()`` has reported."""
        errors = []
        for request in list(self._requests):
            if request._finished and request._reported:
                continue
            try:
                request.wait()
            except OSError as e:
                errors.append(str(e).removeprefix("swapper: "))
        self._requests = []
        if errors:
            raise OSError("swapper: " + "; ".join(errors))

    def allocate(self, key: Any, shape: Sequence[int], dtype: torch.dtype) -> None:
        """Create ``key``'s file with room for a tensor of ``shape`` and ``dtype`` (its blocks reserved:
        a full disk is an error now, naming the path and the bytes), without any tensor in memory:
        ``swap_out(..., offset=)`` then fills it piece by piece (a key larger than RAM). Reading
        bytes not written yet gives zeros. The key must be new."""
        _hashable(key)
        if key in self._entries or self._spans.get(key):
            raise ValueError(f"allocate: key {key!r} exists already; release it first")
        shape = tuple(int(n) for n in shape)
        if any(n < 0 for n in shape):
            raise ValueError(f"allocate: key {key!r}: the shape must have sizes >= 0, got {shape}")
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        path = self._file_for(key)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise OSError(e.errno, f"allocate: cannot reserve {nbytes} bytes for key {key!r} in '{path}': "
                          f"{e.strerror}") from None
        os.close(fd)
        self._entries[key] = _Entry(shape, dtype, nbytes, path)

    def release(self, keys: Sequence[Any]) -> None:
        """Forget the keys and remove their files (no request may be using them)."""
        self._reap()
        keys = list(keys)
        for key in keys:
            self._entry(key, "release")
            if self._spans.get(key):
                raise ValueError(f"release: key {key!r} is in use by an unfinished request; wait() for it first")
        for key in keys:
            entry = self._entries.pop(key)
            entry.path.unlink(missing_ok=True)
            _spare(entry.path).unlink(missing_ok=True)

    def keys(self) -> list[Any]:
        return list(self._entries)

    def path_of(self, key: Any) -> Path:
        return self._entry(key, "path_of").path

    def close(self) -> None:
        """Finish pending transfers (raising their errors) and stop the handle (the keys' files
        stay, ``release`` removes them; their spare files, previous versions, are removed)."""
        try:
            self.wait()
        finally:
            self._handle.close()
            for entry in self._entries.values():
                _spare(entry.path).unlink(missing_ok=True)

    def __enter__(self) -> TensorSwapper:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------------
    def _entry(self, key: Any, what: str) -> _Entry:
        _hashable(key)
        if any(s.whole for s in self._spans.get(key, ())):
            raise ValueError(f"{what}: key {key!r} is still being written by a swap_out request; "
                             "wait() for that request first")
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"{what}: unknown key {key!r} ({len(self._entries)} keys are swapped out)") from None

    def _check_free(self, key: Any, start: int, end: int, *, write: bool, whole: bool, what: str) -> None:
        """Refuse a transfer that would race with an unfinished one on the same bytes."""
        for span in self._spans.get(key, ()):
            if not (write or span.write):
                continue  # reads of the same bytes may overlap
            if whole and not span.write:
                continue  # a whole write replaces the file by rename: readers keep the old one
            if whole or span.whole or (start < span.end and span.start < end):
                raise ValueError(f"{what}: key {key!r}: bytes [{start}, {end}) are being "
                                 f"{'written' if span.write else 'read'} by an unfinished request "
                                 f"(bytes [{span.start}, {span.end})); wait() for it first")

    def _file_for(self, key: Any) -> Path:
        text = str(key)
        readable = re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:80]
        digest = hashlib.sha1(f"{type(key).__name__}:{text}".encode()).hexdigest()[:12]
        return self.swap_dir / f"{readable}.{digest}.swp"

    def _start_whole_write(self, request: SwapRequest, tensor: torch.Tensor, key: Any, nbytes: int) -> None:
        path = self._file_for(key)
        entry = _Entry(tuple(tensor.shape), tensor.dtype, nbytes, path)
        # The spare (the key's previous version, exchanged out by the last whole write) is written
        # into again unless a read of the key is unfinished: that read may hold it open.
        reuse = not self._spans.get(key)
        self._temp_count += 1
        tmp = _spare(path) if reuse else path.with_name(f"{path.name}.tmp{os.getpid()}.{self._temp_count}")
        if nbytes == 0:
            tmp.write_bytes(b"")
            os.replace(tmp, path)
            self._entries[key] = entry
            return

        def on_end(ok: bool) -> None:
            if ok:  # the I/O thread renamed tmp to path (the old version, if any, is now tmp)
                self._entries[key] = entry
                if not reuse:
                    tmp.unlink(missing_ok=True)  # the spare stays what it was
            else:
                tmp.unlink(missing_ok=True)
                request._errors.append(f"key {key!r} was not swapped out (its file '{path}' is unchanged)")
        self._start(request, key, True, tensor, tmp, 0, nbytes, whole=True, rename_to=path, on_end=on_end)

    def _start(self, request: SwapRequest, key: Any, write: bool, tensor: torch.Tensor, path: Path, offset: int,
               nbytes: int, *, whole: bool, rename_to: Path | None = None,
               on_end: Callable[[bool], None] | None = None) -> None:
        if nbytes == 0:
            return
        span = _Span(offset, offset + nbytes, write, whole, request)
        flat = tensor.reshape(-1)
        try:
            op = self._handle._start(write, flat, path, offset, rename_to=rename_to, keep_size=not whole)
        except OSError as e:  # could not even start (e.g. the swap directory vanished)
            request._errors.append(f"key {key!r}: {e}")
            if on_end is not None:
                on_end(False)
            return
        self._spans.setdefault(key, []).append(span)

        def end(ok: bool) -> None:
            spans = self._spans.get(key, [])
            if span in spans:
                spans.remove(span)
            if not spans:
                self._spans.pop(key, None)
            if on_end is not None:
                on_end(ok)
        request._ops.append((key, op, end))

    def _track(self, request: SwapRequest) -> SwapRequest:
        if not request._ops:
            request._finish()  # nothing in flight (empty tensors, or every start failed)
        if not request._finished or request._errors:
            self._requests.append(request)
        return request

    def _finished(self, request: SwapRequest) -> None:
        self._handle._log_notes()
        if not request._errors and request in self._requests:
            self._requests.remove(request)

    def _reap(self) -> None:
        """Finish the bookkeeping of requests whose transfers have ended (registering written
        keys), without blocking; failed ones stay until a wait() reports them."""
        for request in list(self._requests):
            if request._finished and request._reported:
                self._requests.remove(request)
            else:
                request.done()


def _spare(path: Path) -> Path:
    """Where a key's previous version is kept, and its next whole write goes."""
    return path.with_name(f"{path.name}.tmp{os.getpid()}")


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"swapper keys must be hashable (str, int, tuple), got {key!r}") from None
    return key


def _check_tensor(tensor: Any, key: Any, what: str) -> int:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: key {key!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{what}: key {key!r}: the tensor is on {tensor.device}; the swapper moves CPU tensors "
                         "(copy to a page-locked CPU buffer first)")
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: key {key!r}: the tensor must be contiguous, got shape {tuple(tensor.shape)} "
                         f"with strides {tensor.stride()}")
    return tensor.numel() * tensor.element_size()


def _offsets(offset: int | Sequence[int] | None, count: int, what: str) -> list[int | None]:
    values = [offset] * count if offset is None or isinstance(offset, int) else list(offset)
    if len(values) != count:
        raise ValueError(f"{what}: {count} keys but {len(values)} offsets")
    for value in values:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{what}: offset must be None (the whole key) or a byte offset >= 0, got {value!r}")
    return values


def _check_range(key: Any, entry: _Entry, start: int, nbytes: int, what: str) -> None:
    if start + nbytes > entry.nbytes:
        raise ValueError(f"{what}: key {key!r} holds {entry.nbytes} bytes; {nbytes} bytes at offset {start} do not "
                         "fit inside it")


def _aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor whose data starts on a 4096-byte boundary."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGNMENT
    return raw[skip:skip + nbytes].view(dtype).view(shape)
