"""ZeRO-Infinity's optimizer offload: Adam's states (and a 16-bit model's float32 master copy) of this
rank's partition live in files on NVMe, in ``sub_group_size`` chunks; a step reads each chunk, steps
it with ``ds_ops.adam_step`` and writes it back, through ds-io's `TensorSwapper`.

With ``pipeline_read`` the next chunk is read while this one is stepped, with ``pipeline_write`` a
chunk's write goes on while the next is stepped: two sets of chunk buffers instead of one. RAM holds
only those buffers (``memory_bytes``), the disk ``offloaded_bytes``.

Before anything is written, `check_nvme_path` makes sure the directory is writable and has room for
every byte, and says which path and how many bytes otherwise: a full disk is an error at start, not
a torn state mid-step.
"""

from __future__ import annotations

import os
import shutil
import uuid
import weakref
from pathlib import Path
from typing import Any

import torch

import ds_ops
from ds_io import AioConfig, TensorSwapper

STATES = ("exp_avg", "exp_avg_sq")
PARAMS = "params"  # the key of the whole parameter partition, when the parameters are on NVMe too


def check_nvme_path(path: str | os.PathLike, needed: int, what: str) -> Path:
    """The directory for ``needed`` bytes of ``what``: created if missing; an error naming the path and
    the bytes when it cannot be written or has less room."""
    root = Path(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".ds_zero_probe_{uuid.uuid4().hex}"
        probe.write_bytes(b"\0" * 4096)
        probe.unlink()
    except OSError as e:
        raise OSError(f"nvme_path '{root}' is not a writable directory ({e.strerror or e}); {what} needs "
                      f"{needed} bytes ({needed / 2**30:.2f} GiB) there") from None
    free = shutil.disk_usage(root).free
    if free < needed:
        raise OSError(f"nvme_path '{root}' has {free} bytes free ({free / 2**30:.2f} GiB); {what} needs {needed} "
                      f"bytes ({needed / 2**30:.2f} GiB): free space or point nvme_path elsewhere")
    return root


class NvmeOptimizer:
    """Adam over this rank's ``numel``-element partition with its states on NVMe (see the module
    docstring). ``master``: the float32 master copy is on NVMe too (16-bit models; in float32 the
    partition is the master and stays in RAM)."""

    def __init__(self, numel: int, *, sub_group_size: int, master: bool, nvme_path: str, aio: Any, rank: int,
                 pipeline_read: bool, pipeline_write: bool, param_dtype: torch.dtype | None = None):
        self.numel, self.master = numel, master
        self.param_dtype = param_dtype  # the parameter partition's dtype when it is on NVMe too, else None
        self.kinds = (("master",) if master else ()) + STATES
        self.chunks = [(start, min(sub_group_size, numel - start)) for start in range(0, numel, sub_group_size)]
        self._param_size = param_dtype.itemsize if param_dtype is not None else 0
        self.offloaded_bytes = 4 * numel * len(self.kinds) + self._param_size * numel
        what = " + ".join((*self.kinds, *(("parameters",) if param_dtype is not None else ())))
        root = check_nvme_path(nvme_path, self.offloaded_bytes, f"ZeRO-Infinity (rank {rank}: {what} of {numel} "
                               "elements)")
        self.directory = root / f"ds_zero_optimizer_rank{rank}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        aio_config = aio if isinstance(aio, AioConfig) else AioConfig.from_section_or_ds_config(aio)
        self.swapper = TensorSwapper(self.directory, aio_config)
        # the files go with this object (a constructor that failed after it, a process that ends without close())
        self._remove = weakref.finalize(self, remove_swap_directory, self.swapper, self.directory)
        self.pipeline_read, self.pipeline_write = pipeline_read, pipeline_write
        sets = 2 if (pipeline_read or pipeline_write) and len(self.chunks) > 1 else 1
        largest = max(n for _, n in self.chunks)
        # host buffers (the disk's I/O reads and writes host memory; a device model's come through _offload's)
        self._buffers = [{kind: torch.zeros(largest, dtype=torch.float32, device="cpu") for kind in self.kinds}
                         for _ in range(sets)]
        if param_dtype is not None:
            for buffers in self._buffers:
                buffers["param"] = torch.zeros(largest, dtype=param_dtype, device="cpu")
        self._writes: list[Any] = [None] * sets
        self.bytes_read = self.bytes_written = 0  # by the optimizer's steps
        self.fetch_bytes_read = 0  # parameter shards read for stage 3's gathers
        if param_dtype is not None:  # filled by `write_params` (or `initialize`) piece by piece
            self.swapper.allocate(PARAMS, (numel,), param_dtype)

    def initialize(self, partition: torch.Tensor | None) -> None:
        """Zero states and (``master``) the float32 value of the partition into every chunk's files.
        With the parameters on NVMe, ``partition`` is written to its file (the caller may free it
        then), or is None: `write_params` has written every piece already, and the master copy is
        made from the file."""
        if self.param_dtype is not None and partition is not None:
            self.write_params(0, partition)
        buffers = self._buffers[0]
        for i, (start, n) in enumerate(self.chunks):
            for kind in STATES:
                buffers[kind][:n].zero_()
            if self.master:
                if partition is None:
                    self.start_read_params(start, n, out=buffers["param"][:n], fetch=False)[0].wait()
                    buffers["master"][:n].copy_(buffers["param"][:n])
                else:
                    buffers["master"][:n].copy_(partition[start:start + n])
            self.swapper.swap_out([buffers[k][:n] for k in self.kinds], keys=self._keys(i)).wait()

    def _keys(self, chunk: int) -> list[str]:
        return [f"{kind}.{chunk}" for kind in self.kinds]

    def _read(self, chunk: int, which: int) -> list[Any]:
        start, n = self.chunks[chunk]
        for write in self._writes[which] or ():  # that buffer set's last chunk must be on disk first
            write.wait()
        self._writes[which] = None
        self.bytes_read += 4 * n * len(self.kinds)
        buffers = self._buffers[which]
        reads = [self.swapper.swap_in(self._keys(chunk), out=[buffers[k][:n] for k in self.kinds])]
        if self.param_dtype is not None and not self.master:  # float32 on NVMe: the parameters are the master
            reads.append(self.start_read_params(start, n, out=buffers["param"][:n], fetch=False)[0])
            self.bytes_read += self._param_size * n
        return reads

    def start_read_params(self, start: int, n: int, out: torch.Tensor | None = None,
                          fetch: bool = True) -> tuple[Any, torch.Tensor]:
        """Start reading elements ``[start, start + n)`` of the parameter partition (on NVMe);
        ``fetch``: for a gather (counted in ``fetch_bytes_read``), not for the optimizer's step."""
        out = torch.empty(n, dtype=self.param_dtype, device="cpu") if out is None else out
        if fetch:
            self.fetch_bytes_read += n * self._param_size
        return self.swapper.swap_in([PARAMS], out=[out], offset=start * self._param_size), out

    def write_params(self, start: int, values: torch.Tensor) -> None:
        """Overwrite elements ``[start, start + len(values))`` of the parameter partition (on NVMe)."""
        values = values.to("cpu").contiguous()  # from a device: through the host
        self.swapper.swap_out([values], keys=[PARAMS], offset=start * self._param_size).wait()

    def step(self, params: torch.Tensor | None, grads: torch.Tensor, step: int, hyper: dict[str, Any],
             grad_scale: float) -> None:
        """One Adam step of the whole partition: ``params`` (float32: the master; 16-bit: receives the
        rounded update; None when the parameters are on NVMe: read and written here) and ``grads`` (the
        reduced gradient partition), chunk by chunk."""
        sets = len(self._buffers)
        on_disk = self.param_dtype is not None
        reads = {0: self._read(0, 0)}
        for i, (start, n) in enumerate(self.chunks):
            which = i % sets
            if self.pipeline_read and i + 1 < len(self.chunks):
                reads[i + 1] = self._read(i + 1, (i + 1) % sets)
            for read in reads.pop(i):
                read.wait()
            buffers = self._buffers[which]
            weights = buffers["param"][:n] if on_disk else params[start:start + n]
            master = buffers["master"][:n] if self.master else weights
            ds_ops.adam_step(master, grads[start:start + n], buffers["exp_avg"][:n], buffers["exp_avg_sq"][:n], step,
                             grad_scale=grad_scale, half_copy=weights if self.master else None,
                             check_finite=False, **hyper)
            # in place (offset 0): a whole-key write would keep the previous version as a spare file
            writes = [self.swapper.swap_out([buffers[k][:n] for k in self.kinds], keys=self._keys(i), offset=0)]
            self.bytes_written += 4 * n * len(self.kinds)
            if on_disk:
                writes.append(self.swapper.swap_out([weights], keys=[PARAMS], offset=start * self._param_size))
                self.bytes_written += self._param_size * n
            if self.pipeline_write:
                self._writes[which] = writes
            else:
                for write in writes:
                    write.wait()
            if not self.pipeline_read and i + 1 < len(self.chunks):
                reads[i + 1] = self._read(i + 1, (i + 1) % sets)
        for which, writes in enumerate(self._writes):
            for write in writes or ():
                write.wait()
            self._writes[which] = None

    def _spans(self, start: int, n: int) -> list[tuple[int, int, int, int]]:
        """Where elements ``[start, start + n)`` of the partition lie: (chunk, offset in the chunk, offset
        in the range, length) for each chunk they touch."""
        out = []
        for i, (lo, m) in enumerate(self.chunks):
            a, b = max(lo, start), min(lo + m, start + n)
            if a < b:
                out.append((i, a - lo, a - start, b - a))
        return out

    def read_range(self, kind: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``[start, start + len(out))`` of ``kind`` (one of `kinds`, or ``"param"``: the
        parameter partition on NVMe) read into ``out`` (checkpoints read one parameter's piece at a time)."""
        if kind == "param":
            self.start_read_params(start, out.numel(), out=out, fetch=False)[0].wait()
            return out
        for read in [self.swapper.swap_in([f"{kind}.{i}"], out=[out[at:at + m]], offset=offset * 4)
                     for i, offset, at, m in self._spans(start, out.numel())]:
            read.wait()
        return out

    def write_range(self, kind: str, start: int, values: torch.Tensor) -> None:
        """Overwrite elements ``[start, start + len(values))`` of ``kind`` (as `read_range`) in place:
        GatheredParameters' changes to the master copy, a checkpoint's pieces."""
        values = values.reshape(-1).to("cpu")  # from a device: through the host
        if kind == "param":
            self.write_params(start, values)
            return
        for write in [self.swapper.swap_out([values[at:at + m].contiguous()], keys=[f"{kind}.{i}"], offset=offset * 4)
                      for i, offset, at, m in self._spans(start, values.numel())]:
            write.wait()

    def params_from_master(self, partition: torch.Tensor | None) -> None:
        """The 16-bit parameters rounded from the master copy on NVMe (a checkpoint loaded into it), into
        ``partition`` (in RAM), or into their file when it is None (on NVMe too)."""
        buffers = self._buffers[0]
        for i, (start, n) in enumerate(self.chunks):
            self.swapper.swap_in([self._keys(i)[0]], out=[buffers["master"][:n]]).wait()
            if partition is not None:
                partition[start:start + n].copy_(buffers["master"][:n])
            else:
                self.write_params(start, buffers["param"][:n].copy_(buffers["master"][:n]))

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every kind's whole partition read back (tests, checkpoints)."""
        out = {kind: torch.empty(self.numel, dtype=torch.float32, device="cpu") for kind in self.kinds}
        for i, (start, n) in enumerate(self.chunks):
            self.swapper.swap_in(self._keys(i), out=[out[k][start:start + n] for k in self.kinds]).wait()
        return out

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for buffers in self._buffers for t in buffers.values())

    def close(self) -> None:
        """Finish the I/O and remove the files."""
        self._remove()


def remove_swap_directory(swapper: TensorSwapper, directory: Path) -> None:
    """Finish ``swapper``'s I/O and remove its directory."""
    try:
        swapper.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
