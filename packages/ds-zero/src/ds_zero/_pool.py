"""`GatherPool`: stage 3's released gather buffers, kept by size for reuse. Units of one model repeat a few
sizes; reuse keeps the allocator from fragmenting the heap with buffers of 1-16 MiB freed and allocated every
step (RSS, and page faults)."""

from __future__ import annotations

import torch


class GatherPool:
    """Gather buffers of ``dtype`` on ``device``: `take` one, `give` it back once released."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self._free: dict[int, list[torch.Tensor]] = {}

    def take(self, numel: int) -> torch.Tensor:
        """A released buffer of ``numel`` elements when there is one, else a new one."""
        free = self._free.get(numel)
        return free.pop() if free else torch.empty(numel, dtype=self.dtype, device=self.device)

    def give(self, full: torch.Tensor) -> None:
        """Keep a released buffer for reuse only if no other tensor shares its storage (a user's, one autograd
        saved): it keeps its values. Torch has no public query for that (getrefcount, weakref see Python objects)."""
        try:
            alone = torch._C._storage_Use_Count(full.untyped_storage()._cdata) <= 2  # `full` and this query
        except (AttributeError, RuntimeError):  # a torch without the query: never reuse
            alone = False
        if alone:
            self._free.setdefault(full.numel(), []).append(full)

    def clear(self) -> None:
        self._free.clear()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for free in self._free.values() for t in free)
