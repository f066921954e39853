"""Checkpoint entries whose bytes live in ZeRO-Infinity's files (`NvmeOptimizer`): the float32 master
copy (16-bit models: its own file; float32 with the parameters on NVMe: the parameter file) and Adam's
states of this rank's partition.

The checkpoint's layout is the one every ZeRO checkpoint has (`_checkpoint`): each rank's piece of each
whole flattened parameter, a `ShardedTensor` per entry. Here the local shard of such an entry is a
placeholder, a slice of one ``torch.empty`` of the partition's size per kind (never written nor read,
so its pages are never touched and take no RAM), and DCP's planners move the bytes: saving,
`resolve_data` reads the piece from disk when the writer asks for it; loading, `resolve_tensor` hands
DCP a buffer for the range it reads and `commit_tensor` writes it to disk. RAM holds one piece at a
time, so a model whose states exceed RAM saves and loads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

from ._nvme import NvmeOptimizer


class NvmeEntries:
    """The entries of one save or load whose bytes are on NVMe: ``fqn -> (kind, partition offset,
    elements)`` (see the module docstring)."""

    def __init__(self, nvme: NvmeOptimizer):
        self.nvme = nvme
        # where the master copy is: its own file (16-bit), the parameter file (float32 parameters on
        # NVMe), or None: in RAM (float32 parameters in RAM are the master copy)
        self.master_kind = "master" if nvme.master else ("param" if nvme.param_dtype is not None else None)
        self.where: dict[str, tuple[str, int, int]] = {}
        self._placeholders: dict[str, torch.Tensor] = {}

    def placeholder(self, kind: str, start: int, n: int) -> torch.Tensor:
        """A slice of ``kind``'s placeholder (float32, the partition's size, untouched)."""
        if kind not in self._placeholders:
            self._placeholders[kind] = torch.empty(self.nvme.numel, dtype=torch.float32)
        return self._placeholders[kind][start:start + n]

    def add(self, fqn: str, kind: str, start: int, n: int) -> None:
        self.where[fqn] = (kind, start, n)

    def save_planner(self) -> DefaultSavePlanner:
        return _SavePlanner(self)

    def load_planner(self) -> DefaultLoadPlanner:
        return _LoadPlanner(self)


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner, but an entry on NVMe is read from disk when the writer asks for its bytes."""

    def __init__(self, entries: NvmeEntries):
        super().__init__()
        self._entries = entries

    def resolve_data(self, write_item: Any) -> Any:
        where = self._entries.where.get(write_item.index.fqn)
        if where is None:
            return super().resolve_data(write_item)
        kind, start, n = where
        return self._entries.nvme.read_range(kind, start, torch.empty(n, dtype=torch.float32))


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but a range of an entry on NVMe is read into a buffer of its own and written to
    disk once DCP has filled it."""

    def __init__(self, entries: NvmeEntries):
        super().__init__()
        self._entries = entries

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        if read_item.dest_index.fqn not in self._entries.where:
            return super().resolve_tensor(read_item)
        return torch.empty(list(read_item.lengths), dtype=torch.float32)

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        where = self._entries.where.get(read_item.dest_index.fqn)
        if where is None:
            return super().commit_tensor(read_item, tensor)
        kind, start, _ = where
        self._entries.nvme.write_range(kind, start + read_item.dest_offsets[0], tensor)
        return None
