"""`AsyncIOHandle` (alias `aio_handle`): DeepNVMe's handle API over the native ``async_io`` op.

    h = AsyncIOHandle(block_size=1 << 20, queue_depth=32, intra_op_parallelism=2)
    h.sync_pwrite(t, "/nvme/t.bin")           # blocking; -> 1 (operations completed)
    h.async_pread(u, "/nvme/t.bin"); ...; h.wait()   # -> 0 at once; overlapped with compute; wait() -> 1

Python owns the tensors: it passes (data_ptr, nbytes) to C++ and keeps every tensor of an
asynchronous operation alive until ``wait()`` returns, even if the caller drops it. CUDA tensors
travel through a pinned host bounce buffer. Fallbacks from O_DIRECT (unaligned offset or size,
a filesystem that refuses it) are logged with their reason.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from ds_ops import get_accelerator

from ._limits import check_range
from .op_builder import AsyncIOBuilder

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


@functools.cache
def _core():
    return AsyncIOBuilder().load()


class AsyncIOHandle:
    """Asynchronous tensor file I/O with a pool of ``intra_op_parallelism`` worker threads.

    Arguments and defaults are DeepSpeed's ``aio_handle``; their ranges are in ``ds_io._limits``
    (``ValueError`` naming the argument and the range outside them). Keyword-only extras:
    ``use_direct_io`` (O_DIRECT where alignment allows, default True), ``buffered_reads`` (reads
    go through the page cache, ``block_size x queue_depth`` bytes per call (at most 256 MiB) so
    that the kernel's readahead keeps large reads in flight; writes stay O_DIRECT; default False;
    ``ds-nvme-tune`` measures which is faster) and
    ``use_libaio`` (Linux AIO when the op was built with it, default True; False uses
    pread/pwrite workers).
    """

    def __init__(self, block_size: int = 1048576, queue_depth: int = 128, single_submit: bool = False,
                 overlap_events: bool = False, intra_op_parallelism: int = 1, *, use_direct_io: bool = True,
                 buffered_reads: bool = False, use_libaio: bool = True):
        self._block_size = check_range("block_size", block_size)
        self._queue_depth = check_range("queue_depth", queue_depth)
        self._single_submit = _bool("single_submit", single_submit)
        self._overlap_events = _bool("overlap_events", overlap_events)
        self._intra_op_parallelism = check_range("intra_op_parallelism", intra_op_parallelism)
        self._direct = _bool("use_direct_io", use_direct_io)
        self._buffered_reads = _bool("buffered_reads", buffered_reads)
        core = _core()
        self._handle = core.AioHandle(block_size, queue_depth, single_submit, overlap_events,
                                      intra_op_parallelism, _bool("use_libaio", use_libaio))
        self._keep_alive: list[torch.Tensor] = []  # tensors of operations not yet waited for
        self._after_wait: list[Callable[[], None]] = []  # CUDA copies, validations
        self._locked: dict[int, object] = {}  # data_ptr of a locked tensor -> what owns its memory
        self._closed = False

    # ---- settings (DeepSpeed's getters) -------------------------------------------------------
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._intra_op_parallelism

    def uses_libaio(self) -> bool:
        return self._handle.uses_libaio()

    def uses_buffered_reads(self) -> bool:
        return self._buffered_reads or not self._direct

    # ---- I/O (DeepSpeed's names: buffer, filename, validate, file_offset; `async` is async_op) ----
    # Synchronous calls return the number of operations completed (1), asynchronous ones 0 once
    # started (their count comes from wait()), as DeepSpeed's handle does.
    def pread(self, buffer: torch.Tensor, filename: PathLike, validate: bool = False, async_op: bool = False,
              file_offset: int = 0) -> int:
        """Read ``buffer.nbytes`` bytes of ``filename`` from ``file_offset`` into ``buffer``."""
        return self._io(False, buffer, filename, validate, async_op, file_offset)

    def pwrite(self, buffer: torch.Tensor, filename: PathLike, validate: bool = False, async_op: bool = False,
               file_offset: int = 0) -> int:
        """Write ``buffer``'s bytes to ``filename`` at ``file_offset`` (a write at offset 0 makes the
        file exactly the buffer's size; files are never truncated otherwise)."""
        return self._io(True, buffer, filename, validate, async_op, file_offset)

    def sync_pread(self, buffer: torch.Tensor, filename: PathLike, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, async_op=False, file_offset=file_offset)

    def sync_pwrite(self, buffer: torch.Tensor, filename: PathLike, file_offset: int = 0) -> int:
        return self.pwrite(buffer, filename, async_op=False, file_offset=file_offset)

    def async_pread(self, buffer: torch.Tensor, filename: PathLike, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, async_op=True, file_offset=file_offset)

    def async_pwrite(self, buffer: torch.Tensor, filename: PathLike, file_offset: int = 0) -> int:
        return self.pwrite(buffer, filename, async_op=True, file_offset=file_offset)

    def read(self, buffer: torch.Tensor, filename: PathLike, validate: bool = False, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, validate=validate, file_offset=file_offset)

    def write(self, buffer: torch.Tensor, filename: PathLike, validate: bool = False, file_offset: int = 0) -> int:
        return self.pwrite(buffer, filename, validate=validate, file_offset=file_offset)

    def wait(self) -> int:
        """Block until every asynchronous operation completes; returns how many did. Raises
        ``OSError`` naming each failed operation's path, offset and size, and ``ValueError`` when
        nothing is pending."""
        self._check_open("wait")
        try:
            completed = self._handle.wait()
            for action in self._after_wait:
                action()
        finally:
            self._keep_alive.clear()
            self._after_wait.clear()
            self._log_notes()
        return completed

    def pending(self) -> int:
        """Asynchronous operations started and not yet waited for."""
        return self._handle.pending()

    # ---- page-locked buffers ---------------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A 1-D CPU tensor of ``num_elem`` elements of ``example_tensor``'s dtype in page-locked,
        4096-byte aligned memory (pinned through the accelerator seam, ``ds_ops.get_accelerator()``,
        when it is CUDA; else ``mlock``ed)."""
        self._check_open("new_cpu_locked_tensor")
        _positive_int("num_elem", num_elem)
        dtype = example_tensor.dtype
        nbytes = num_elem * torch.empty((), dtype=dtype).element_size()
        accelerator = get_accelerator()
        if not accelerator.is_synchronized_device():  # a GPU: memory it can copy from asynchronously
            tensor = accelerator.pinned_empty(num_elem, dtype)
            self._locked[tensor.data_ptr()] = tensor
            return tensor
        return self._new_mlocked(num_elem, dtype, nbytes)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Give back a tensor of ``new_cpu_locked_tensor``; its memory is released once no view of
        it is alive any more (never under a live tensor). Returns False, as DeepSpeed does, for a
        tensor this handle did not make or already freed (and logs it)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"free_cpu_locked_tensor: expected a torch.Tensor, got {type(tensor).__name__}")
        if self._locked.pop(tensor.data_ptr(), None) is None:
            logger.warning("free_cpu_locked_tensor: the tensor at 0x%x (shape %s, %s) was not made by this "
                           "handle's new_cpu_locked_tensor, or was freed already: nothing freed",
                           tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
            return False
        return True

    def _new_mlocked(self, num_elem: int, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        core = _core()
        address, note = core.alloc_locked(nbytes)
        if note:
            logger.warning("new_cpu_locked_tensor: %s", note)
        size = max(core.ALIGNMENT, -(-nbytes // core.ALIGNMENT) * core.ALIGNMENT)
        owner = (ctypes.c_ubyte * size).from_address(address)
        weakref.finalize(owner, core.free_locked, address, nbytes)
        tensor = torch.frombuffer(owner, dtype=torch.uint8)[:nbytes].view(dtype)
        self._locked[tensor.data_ptr()] = owner
        return tensor

    # ---- life cycle --------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish outstanding operations (raising their errors) and stop the workers."""
        if self._closed:
            return
        try:
            if self._handle.pending():
                self.wait()
        finally:
            self._closed = True
            self._handle.close()

    def __enter__(self) -> AsyncIOHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"AsyncIOHandle(block_size={self._block_size}, queue_depth={self._queue_depth}, "
                f"single_submit={self._single_submit}, overlap_events={self._overlap_events}, "
                f"intra_op_parallelism={self._intra_op_parallelism}, "
                f"backend={'libaio' if self.uses_libaio() else 'pread/pwrite'}"
                f"{', buffered_reads=True' if self._buffered_reads else ''}"
                f"{', closed' if self._closed else ''})")

    # ---- internals ---------------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ValueError(f"{what}: this aio handle is closed; create a new AsyncIOHandle")

    def _io(self, write: bool, tensor: torch.Tensor, path: PathLike, validate: bool, async_op: bool,
            file_offset: int) -> int:
        verb = "pwrite" if write else "pread"
        path, nbytes = self._check_io(verb, write, tensor, path, file_offset)
        host, after = self._host_view(write, tensor, path, verb)
        actions = [after] if after else []
        if validate:
            actions.append(functools.partial(_validate, write, host, path, file_offset))
        direct = self._direct and (write or not self._buffered_reads)
        if async_op:
            self._handle.submit(write, host.data_ptr(), nbytes, path, file_offset, direct, True)
            self._keep_alive.extend((tensor, host))
            self._after_wait.extend(actions)
            return 0
        try:
            self._handle.run(write, host.data_ptr(), nbytes, path, file_offset, direct)
        finally:
            self._log_notes()
        for action in actions:
            action()
        return 1

    def _check_io(self, verb: str, write: bool, tensor: torch.Tensor, path: PathLike, file_offset: int):
        self._check_open(verb)
        path = os.fspath(path)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{verb}('{path}'): expected a torch.Tensor, got {type(tensor).__name__}")
        if isinstance(file_offset, bool) or not isinstance(file_offset, int) or file_offset < 0:
            raise ValueError(f"{verb}('{path}'): file_offset must be an integer >= 0, got {file_offset!r}")
        if not tensor.is_contiguous():
            raise ValueError(f"{verb}('{path}'): the tensor must be contiguous, got shape {tuple(tensor.shape)} "
                             f"with strides {tensor.stride()}; pass tensor.contiguous()")
        nbytes = tensor.numel() * tensor.element_size()
        if write:
            parent = Path(path).parent
            if not parent.is_dir():
                raise FileNotFoundError(f"cannot write {nbytes} bytes to '{path}' at offset {file_offset}: "
                                        f"directory '{parent}' does not exist")
        return path, nbytes

    def _start(self, write: bool, tensor: torch.Tensor, path: PathLike, file_offset: int = 0,
               rename_to: PathLike | None = None, keep_size: bool = False):
        """Queue one operation on a contiguous CPU tensor and return the native operation (its own
        ``done()``/``wait()``); not counted by ``wait()``/``pending()``. Its files are opened when
        a worker reaches it (queued operations hold no file descriptors), so errors, opening ones
        included, come from its ``wait()``. The caller keeps ``tensor`` alive until it is done.
        ``rename_to``: a write's file takes this name once all its bytes are written (never when
        it fails); a file that had that name takes ``path`` instead of being removed (an atomic
        exchange; a plain rename where the filesystem cannot exchange), for the caller to write
        into again or remove. ``keep_size``: a write at offset 0 leaves a longer file as long as
        it was (``pwrite`` truncates it to the bytes written, as DeepSpeed's does)."""
        verb = "pwrite" if write else "pread"
        path, nbytes = self._check_io(verb, write, tensor, path, file_offset)
        if tensor.device.type != "cpu":
            raise ValueError(f"{verb}('{path}'): expected a CPU tensor, got one on {tensor.device}")
        direct = self._direct and (write or not self._buffered_reads)
        return self._handle.submit(write, tensor.data_ptr(), nbytes, path, file_offset, direct, False,
                                   os.fspath(rename_to) if rename_to is not None else "", True, keep_size)

    def _host_view(self, write: bool, tensor: torch.Tensor, path: str, verb: str):
        """The CPU tensor the op works on, and what to do after a read completes (CUDA copy)."""
        if tensor.device.type == "cpu":
            return tensor, None
        if tensor.device.type != "cuda":
            raise ValueError(f"{verb}('{path}'): tensors must be on CPU or CUDA, got {tensor.device}")
        bounce = get_accelerator().pinned_empty(tensor.shape, tensor.dtype)
        if write:
            bounce.copy_(tensor)
            return bounce, None
        return bounce, lambda: tensor.copy_(bounce)

    def _log_notes(self) -> None:
        for note in self._handle.take_notes():
            logger.info("async_io: %s", note)


def _validate(write: bool, tensor: torch.Tensor, path: str, file_offset: int) -> None:
    """Compare the tensor's bytes with the file's, read back with plain Python file I/O."""
    nbytes = tensor.numel() * tensor.element_size()
    with open(path, "rb") as f:
        f.seek(file_offset)
        data = f.read(nbytes)
    mine = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if nbytes else b""
    if data != mine:
        first = next((i for i, (a, b) in enumerate(zip(data, mine, strict=False)) if a != b), min(len(data), nbytes))
        raise OSError(f"validate: after {'pwrite' if write else 'pread'} of {nbytes} bytes at offset {file_offset}, "
                      f"'{path}' and the tensor differ from byte {first} on")


aio_handle = AsyncIOHandle


# ---- GPUDirect Storage ---------------------------------------------------------------------------
def gds_available() -> bool:
    """True when NVIDIA GPUDirect Storage can be used: a CUDA GPU and the cuFile library."""
    return _gds_missing() == ""


def _gds_missing() -> str:
    if not torch.cuda.is_available():
        return "no CUDA GPU is available"
    if ctypes.util.find_library("cufile") is None:
        return "the cuFile library (libcufile.so, NVIDIA GPUDirect Storage) is not installed"
    return ""


class gds_handle(AsyncIOHandle):
    """DeepSpeed's ``gds_handle``. ds-io does not drive cuFile yet: where GPUDirect Storage is
    present this handle moves CUDA tensors through pinned host memory (and says so), and its
    device-pinning methods, which need cuFile, raise ``RuntimeError``; where GPUDirect Storage is
    absent, creating it raises ``RuntimeError`` naming what is missing."""

    def __init__(self, *args, **kwargs):
        missing = _gds_missing()
        if missing:
            raise RuntimeError(f"gds_handle requires GPUDirect Storage (NVIDIA GPU + cuFile), but {missing}; "
                               "use ds_io.aio_handle (works with CPU and CUDA tensors) instead")
        logger.warning("gds_handle: GPUDirect Storage found, but ds-io moves CUDA tensors through pinned "
                       "host memory (cuFile is not driven yet)")
        super().__init__(*args, **kwargs)

    def new_pinned_device_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        _no_cufile("new_pinned_device_tensor")

    def free_pinned_device_tensor(self, tensor: torch.Tensor) -> bool:
        _no_cufile("free_pinned_device_tensor")

    def pin_device_tensor(self, tensor: torch.Tensor) -> None:
        _no_cufile("pin_device_tensor")

    def unpin_device_tensor(self, tensor: torch.Tensor) -> None:
        _no_cufile("unpin_device_tensor")


def _no_cufile(method: str):
    raise RuntimeError(f"gds_handle.{method} requires GPUDirect Storage (NVIDIA GPU + cuFile) buffer "
                       "registration, which ds-io does not implement yet (it moves CUDA tensors through "
                       "pinned host memory); pass CUDA tensors to pread/pwrite directly, without pinning")
