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
from pathlib import Path
from typing import Any

import torch

import ds_ops
from ds_io import AioConfig, TensorSwapper

STATES = ("exp_avg", "exp_avg_sq")


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
                 pipeline_read: bool, pipeline_write: bool):
        self.numel, self.master = numel, master
        self.kinds = (("master",) if master else ()) + STATES
        self.chunks = [(start, min(sub_group_size, numel - start)) for start in range(0, numel, sub_group_size)]
        self.offloaded_bytes = 4 * numel * len(self.kinds)
        root = check_nvme_path(nvme_path, self.offloaded_bytes, f"offload_optimizer (rank {rank}: "
                               f"{' + '.join(self.kinds)} of {numel} elements)")
        self.directory = root / f"ds_zero_optimizer_rank{rank}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        aio_config = aio if isinstance(aio, AioConfig) else AioConfig.from_section_or_ds_config(aio)
        self.swapper = TensorSwapper(self.directory, aio_config)
        self.pipeline_read, self.pipeline_write = pipeline_read, pipeline_write
        sets = 2 if (pipeline_read or pipeline_write) and len(self.chunks) > 1 else 1
        largest = max(n for _, n in self.chunks)
        self._buffers = [{kind: torch.zeros(largest, dtype=torch.float32) for kind in self.kinds} for _ in range(sets)]
        self._writes: list[Any] = [None] * sets
        self.bytes_read = self.bytes_written = 0

    def initialize(self, partition: torch.Tensor) -> None:
        """Zero states and (``master``) the float32 value of ``partition`` into every chunk's files."""
        buffers = self._buffers[0]
        for i, (start, n) in enumerate(self.chunks):
            for kind in STATES:
                buffers[kind][:n].zero_()
            if self.master:
                buffers["master"][:n].copy_(partition[start:start + n])
            self.swapper.swap_out([buffers[k][:n] for k in self.kinds], keys=self._keys(i)).wait()

    def _keys(self, chunk: int) -> list[str]:
        return [f"{kind}.{chunk}" for kind in self.kinds]

    def _read(self, chunk: int, which: int) -> Any:
        n = self.chunks[chunk][1]
        if self._writes[which] is not None:  # that buffer set's last chunk must be on disk first
            self._writes[which].wait()
            self._writes[which] = None
        self.bytes_read += 4 * n * len(self.kinds)
        return self.swapper.swap_in(self._keys(chunk), out=[self._buffers[which][k][:n] for k in self.kinds])

    def step(self, params: torch.Tensor, grads: torch.Tensor, step: int, hyper: dict[str, Any],
             grad_scale: float) -> None:
        """One Adam step of the whole partition: ``params`` (float32: the master; 16-bit: receives the
        rounded update) and ``grads`` (the reduced gradient partition), chunk by chunk."""
        sets = len(self._buffers)
        reads = {0: self._read(0, 0)}
        for i, (start, n) in enumerate(self.chunks):
            which = i % sets
            if self.pipeline_read and i + 1 < len(self.chunks):
                reads[i + 1] = self._read(i + 1, (i + 1) % sets)
            reads.pop(i).wait()
            buffers = self._buffers[which]
            master = buffers["master"][:n] if self.master else params[start:start + n]
            ds_ops.adam_step(master, grads[start:start + n], buffers["exp_avg"][:n], buffers["exp_avg_sq"][:n], step,
                             grad_scale=grad_scale, half_copy=params[start:start + n] if self.master else None,
                             check_finite=False, **hyper)
            # in place (offset 0): a whole-key write would keep the previous version as a spare file
            write = self.swapper.swap_out([buffers[k][:n] for k in self.kinds], keys=self._keys(i), offset=0)
            self.bytes_written += 4 * n * len(self.kinds)
            if self.pipeline_write:
                self._writes[which] = write
            else:
                write.wait()
            if not self.pipeline_read and i + 1 < len(self.chunks):
                reads[i + 1] = self._read(i + 1, (i + 1) % sets)
        for which, write in enumerate(self._writes):
            if write is not None:
                write.wait()
                self._writes[which] = None

    def write_master(self, start: int, values: torch.Tensor) -> None:
        """Overwrite the master copy's elements ``[start, start + len(values))`` (GatheredParameters
        changed them): read, patch and write each chunk they touch."""
        end = start + values.numel()
        buffer = self._buffers[0]["master"]
        for i, (lo, n) in enumerate(self.chunks):
            a, b = max(lo, start), min(lo + n, end)
            if a >= b:
                continue
            key = self._keys(i)[0]
            self.swapper.swap_in([key], out=[buffer[:n]]).wait()
            buffer[a - lo:b - lo].copy_(values[a - start:b - start])
            self.swapper.swap_out([buffer[:n]], keys=[key], offset=0).wait()

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every kind's whole partition read back (tests, checkpoints)."""
        out = {kind: torch.empty(self.numel, dtype=torch.float32) for kind in self.kinds}
        for i, (start, n) in enumerate(self.chunks):
            self.swapper.swap_in(self._keys(i), out=[out[k][start:start + n] for k in self.kinds]).wait()
        return out

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for buffers in self._buffers for t in buffers.values())

    def close(self) -> None:
        """Finish the I/O and remove the files."""
        try:
            self.swapper.close()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
