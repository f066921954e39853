"""`TensorSwapper`: tensors out to files and back, what ZeRO-Infinity offloads through.

    swapper = TensorSwapper("/nvme/swap", AioConfig(), buffer_count=4, buffer_size=1 << 26)
    swapper.swap_out([p1, p2], keys=["layer0.w", "layer0.b"])
    p1, p2 = swapper.swap_in(["layer0.w", "layer0.b"])
    swapper.release(["layer0.w", "layer0.b"])            # their files are removed

Every transfer goes through ``buffer_count`` page-locked, aligned buffers of ``buffer_size``
bytes, each with its own handle: while one buffer's I/O is in flight the next is filled (or
drained), so copies overlap I/O, and O_DIRECT applies whatever the tensors' own alignment. A
tensor larger than a buffer moves in buffer-sized chunks. A key's file is written under a
temporary name and renamed into place once all its bytes are on disk: a failed write never
leaves a half-written file under the final name.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
class _Buffer:
    handle: AsyncIOHandle
    data: torch.Tensor  # uint8, page-locked
    cursor: int = 0
    pending: bool = False
    on_done: list[Callable[[], None]] = field(default_factory=list)
    on_fail: list[Callable[[], None]] = field(default_factory=list)


@dataclass
class _Write:
    key: Any
    entry: _Entry
    tmp: Path
    chunks_left: int
    failed: bool = False


class TensorSwapper:
    """Swap tensors between memory and files in ``swap_dir`` (created if missing)."""

    def __init__(self, swap_dir: str | os.PathLike, aio_config: AioConfig | dict | None = None,
                 buffer_count: int = 2, buffer_size: int = 1 << 24):
        if isinstance(buffer_count, bool) or not isinstance(buffer_count, int) or buffer_count < 1:
            raise ValueError(f"buffer_count must be an integer >= 1, got {buffer_count!r}")
        if isinstance(buffer_size, float) and buffer_size.is_integer():
            buffer_size = int(buffer_size)
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < ALIGNMENT:
            raise ValueError(f"buffer_size must be an integer number of bytes >= {ALIGNMENT}, got {buffer_size!r}")
        config = aio_config if isinstance(aio_config, AioConfig) else AioConfig.model_validate(aio_config or {})
        if config.use_gds and not gds_available():
            raise RuntimeError("aio.use_gds is true, but NVIDIA GPUDirect Storage is not available here "
                               "(see ds_io.gds_available()); set use_gds to false")
        self.swap_dir = Path(swap_dir)
        self.swap_dir.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.buffer_size = buffer_size // ALIGNMENT * ALIGNMENT
        self._buffers: list[_Buffer] = []
        for _ in range(buffer_count):
            handle = AsyncIOHandle(**config.handle_kwargs())
            data = handle.new_cpu_locked_tensor(self.buffer_size, torch.empty(0, dtype=torch.uint8))
            self._buffers.append(_Buffer(handle, data))
        self._current = 0
        self._entries: dict[Any, _Entry] = {}
        self._writing: dict[Any, _Write] = {}
        self._errors: list[str] = []

    # ---- public API ---------------------------------------------------------------------------------
    def swap_out(self, tensors: Sequence[torch.Tensor], keys: Sequence[Any]) -> None:
        """Write each tensor to its key's file; returns when all are on disk under their final names."""
        self.swap_out_async(tensors, keys)
        self.wait()

    def swap_in(self, keys: Sequence[Any], out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Read the keys' tensors (into ``out`` when given, else new CPU tensors) and return them."""
        result = self.swap_in_async(keys, out)
        self.wait()
        return result

    def swap_out_async(self, tensors: Sequence[torch.Tensor], keys: Sequence[Any]) -> None:
        """Start writing; the tensors may be changed as soon as this returns (their bytes are
        copied into the swapper's buffers). ``wait()`` finishes the writes and renames the files."""
        tensors, keys = list(tensors), list(keys)
        if len(tensors) != len(keys):
            raise ValueError(f"swap_out: {len(tensors)} tensors but {len(keys)} keys; give one key per tensor")
        if len(set(map(_hashable, keys))) != len(keys):
            raise ValueError(f"swap_out: the keys repeat: {keys}")
        for key in keys:
            if key in self._writing:
                raise ValueError(f"swap_out: key {key!r} is being written already; wait() first")
        for tensor, key in zip(tensors, keys, strict=True):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"swap_out: key {key!r}: expected a torch.Tensor, got {type(tensor).__name__}")
            self._start_write(tensor, key)

    def swap_in_async(self, keys: Sequence[Any], out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Start reading; the returned tensors hold the data once ``wait()`` returns."""
        keys = list(keys)
        entries = [self._entry(key, "swap_in") for key in keys]
        if out is None:
            out = [torch.empty(e.shape, dtype=e.dtype) for e in entries]
        else:
            out = list(out)
            if len(out) != len(keys):
                raise ValueError(f"swap_in: {len(keys)} keys but {len(out)} output tensors")
            for key, entry, tensor in zip(keys, entries, out, strict=True):
                nbytes = tensor.numel() * tensor.element_size()
                if nbytes != entry.nbytes or not tensor.is_contiguous():
                    raise ValueError(f"swap_in: key {key!r} holds {entry.nbytes} bytes ({entry.dtype}, shape "
                                     f"{entry.shape}); the output tensor must be contiguous with as many bytes, got "
                                     f"{nbytes} bytes ({tensor.dtype}, shape {tuple(tensor.shape)}"
                                     f"{', not contiguous' if not tensor.is_contiguous() else ''})")
        for entry, tensor in zip(entries, out, strict=True):
            self._start_read(entry, tensor)
        return out

    def wait(self) -> None:
        """Finish every transfer started so far; raises ``OSError`` naming the keys that failed."""
        for index in range(len(self._buffers)):
            self._drain(index)
        errors, self._errors = self._errors, []
        if errors:
            raise OSError("swapper: " + "; ".join(errors))

    def release(self, keys: Sequence[Any]) -> None:
        """Forget the keys and remove their files."""
        keys = list(keys)
        for key in keys:
            self._entry(key, "release")
        for key in keys:
            entry = self._entries.pop(key)
            entry.path.unlink(missing_ok=True)

    def keys(self) -> list[Any]:
        return list(self._entries)

    def path_of(self, key: Any) -> Path:
        return self._entry(key, "path_of").path

    def close(self) -> None:
        """Finish pending transfers and stop the handles (files stay; ``release`` removes them)."""
        try:
            self.wait()
        finally:
            for buffer in self._buffers:
                buffer.handle.free_cpu_locked_tensor(buffer.data)
                buffer.handle.close()
            self._buffers = []

    def __enter__(self) -> TensorSwapper:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------------
    def _entry(self, key: Any, what: str) -> _Entry:
        if _hashable(key) in self._writing:
            raise ValueError(f"{what}: key {key!r} is still being written; wait() first")
        try:
            return self._entries[key]
        except (KeyError, TypeError):
            raise KeyError(f"{what}: unknown key {key!r} ({len(self._entries)} keys are swapped out)") from None

    def _file_for(self, key: Any) -> Path:
        text = str(key)
        readable = re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:80]
        digest = hashlib.sha1(f"{type(key).__name__}:{text}".encode()).hexdigest()[:12]
        return self.swap_dir / f"{readable}.{digest}.swp"

    def _reserve(self, nbytes: int) -> tuple[_Buffer, torch.Tensor]:
        """An aligned region of ``nbytes`` (<= buffer_size) in a buffer whose earlier I/O is done."""
        buffer = self._buffers[self._current]
        if buffer.cursor + nbytes > self.buffer_size:
            self._current = (self._current + 1) % len(self._buffers)
            self._drain(self._current)  # the next buffer's I/O finishes; the others' stays in flight
            buffer = self._buffers[self._current]
        start = buffer.cursor
        buffer.cursor = -(-(start + nbytes) // ALIGNMENT) * ALIGNMENT
        return buffer, buffer.data[start:start + nbytes]

    def _drain(self, index: int) -> None:
        buffer = self._buffers[index]
        if buffer.pending:
            try:
                buffer.handle.wait()
                actions = buffer.on_done
            except OSError as e:
                self._errors.append(str(e))
                actions = buffer.on_fail
            for action in actions:
                action()
        buffer.pending = False
        buffer.cursor = 0
        buffer.on_done = []
        buffer.on_fail = []

    def _start_write(self, tensor: torch.Tensor, key: Any) -> None:
        source = tensor.detach().contiguous().reshape(-1).view(torch.uint8) if tensor.numel() else None
        nbytes = tensor.numel() * tensor.element_size()
        path = self._file_for(key)
        entry = _Entry(tuple(tensor.shape), tensor.dtype, nbytes, path)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        if nbytes == 0:
            tmp.write_bytes(b"")
            os.replace(tmp, path)
            self._entries[key] = entry
            return
        chunks = range(0, nbytes, self.buffer_size)
        write = _Write(key, entry, tmp, len(chunks))
        self._writing[key] = write
        for offset in chunks:
            size = min(self.buffer_size, nbytes - offset)
            buffer, region = self._reserve(size)
            region.copy_(source[offset:offset + size])
            try:
                buffer.handle.async_pwrite(region, tmp, file_offset=offset)
            except OSError as e:  # failed to start (e.g. the swap directory vanished)
                self._errors.append(str(e))
                self._write_chunk_done(write, ok=False)
                continue
            buffer.pending = True
            buffer.on_done.append(lambda w=write: self._write_chunk_done(w, ok=True))
            buffer.on_fail.append(lambda w=write: self._write_chunk_done(w, ok=False))

    def _write_chunk_done(self, write: _Write, ok: bool) -> None:
        write.chunks_left -= 1
        write.failed = write.failed or not ok
        if write.chunks_left > 0:
            return
        self._writing.pop(write.key, None)
        if write.failed:
            write.tmp.unlink(missing_ok=True)
            self._errors.append(f"key {write.key!r} was not swapped out (its file '{write.entry.path}' is unchanged)")
            return
        os.replace(write.tmp, write.entry.path)
        self._entries[write.key] = write.entry

    def _start_read(self, entry: _Entry, tensor: torch.Tensor) -> None:
        if entry.nbytes == 0:
            return
        target = tensor.reshape(-1).view(torch.uint8)
        for offset in range(0, entry.nbytes, self.buffer_size):
            size = min(self.buffer_size, entry.nbytes - offset)
            buffer, region = self._reserve(size)
            buffer.handle.async_pread(region, entry.path, file_offset=offset)
            buffer.pending = True
            buffer.on_done.append(lambda t=target, r=region, o=offset, s=size: t[o:o + s].copy_(r))


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"swapper keys must be hashable (str, int, tuple), got {key!r}") from None
    return key
