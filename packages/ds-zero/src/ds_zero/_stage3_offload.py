"""Where stage 3's partition lives, and how this rank's shard of a unit gets into its gather buffer.

Without ``offload_param`` the partition is on the model's device and a gather copies the shard into
its place in the gather buffer there (`ds_comm.all_gather_bucket` does, then gathers in place).

With ``offload_param: {device: cpu}`` (ZeRO-3 parameter offload) the partition lives on the host
(page-locked where the model is on an accelerator), apart from the gather buffers on the device:
a gather first copies this rank's shard host -> device into its place in the buffer, then all-gathers
in place on the device. A unit the trace says comes next is *staged* ahead: its copy is issued when
the prefetch is announced, on a side copy stream that first waits for the work queued on the current
stream (the pooled buffer it writes may still be read there) and records an event the all-gather
waits for, so the copy overlaps the module that computes meanwhile (DeepSpeed's
``stage3_prefetch_bucket_size``). With ``device: nvme`` a shard is read from NVMe into a page-locked
staging buffer (kept for reuse, each with the event of its last copy) and copied up from there.

On the CPU (no streams) the same copies happen, synchronously, between the separate host partition
and the "device" buffers; `ShardMover.counts` (ds_zero._transfer's `TransferCounts`) counts them.
"""

from __future__ import annotations

from typing import Any

import torch

import ds_ops

from ._model import version
from ._transfer import TransferCounts, copy_stream, host_buffer, host_to_device


def offload_param_device(config: Any) -> str:
    """``zero_optimization.offload_param.device``: "none", "cpu" or "nvme"."""
    offload = getattr(config, "offload_param", None)
    return offload.device if offload is not None else "none"


def partition_buffer(numel: int, dtype: torch.dtype, device: torch.device, config: Any, *,
                     stepped_on_host: bool | None = None, on_disk: bool = False) -> torch.Tensor:
    """Stage 3's partition (zeroed): on ``device``, or on the host with ``offload_param`` (page-locked
    for an accelerator model). ``on_disk``: the shards are on NVMe (``offload_param: nvme`` with
    `ZeroOptimizer`): a plain host tensor, left uninitialised (its memory is dropped once the shards
    are written). ``stepped_on_host``: for `ZeroOptimizer`, whether its optimizer steps on the host
    (``offload_optimizer``): an accelerator model's offloaded partition needs it (the optimizer steps
    the partition where it is, with the gradients beside it)."""
    where = offload_param_device(config)
    if where == "none":
        return torch.zeros(numel, dtype=dtype, device=device)
    if on_disk:
        return torch.empty(numel, dtype=dtype, device="cpu")
    if device.type != "cpu" and stepped_on_host is False:
        raise NotImplementedError(f"zero_optimization.offload_param.device 'cpu' for a model on {device} needs "
                                  f"offload_optimizer.device 'cpu' (or 'nvme') too in ds-zero {version()}: the "
                                  "optimizer steps the parameters' partition where it is, on the host")
    return host_buffer(numel, dtype, device)


class ShardMover:
    """This rank's shards from the partition into gather buffers on ``device`` (see the module
    docstring); ``host``: the shards are on the host (``offload_param``), so each is copied up and
    counted. Without it the all-gather copies the shard into place itself (`load` returns it)."""

    def __init__(self, device: torch.device, host: bool):
        self.device, self.host = device, host
        self.counts = TransferCounts()  # host -> device: up_*, device -> host: down_*
        self._stream = copy_stream(device) if host else None  # None on the CPU
        self._staging: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, Any]]] = {}

    def load(self, shard: torch.Tensor, mine: torch.Tensor) -> torch.Tensor | None:
        """Before a gather: ``shard`` into ``mine`` (its place in the gather buffer) on the current stream
        when it is on the host (returns None: gather in place), else ``shard`` (the gather copies it)."""
        if not self.host:
            return shard
        host_to_device(shard, mine, counts=self.counts)
        return None

    def stage(self, shard: torch.Tensor, mine: torch.Tensor) -> Any:
        """A prefetch's copy of ``shard`` (host) into ``mine`` (device), issued now on the side stream after
        the work queued on the current stream; returns the event that marks its end (None: done)."""
        if self._stream is None:
            host_to_device(shard, mine, counts=self.counts)
            return None
        accelerator = ds_ops.get_accelerator()
        self._stream.wait_stream(accelerator.current_stream(self.device))  # `mine` may still be read there
        with accelerator.stream(self._stream):
            host_to_device(shard, mine, counts=self.counts)
            done = accelerator.Event()
            done.record(self._stream)
        return done

    def wait(self, event: Any) -> None:
        """The current stream waits for a staged copy (nothing for None: done)."""
        if event is not None:
            ds_ops.get_accelerator().current_stream(self.device).wait_event(event)

    def store(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """``source`` (a device shard) into ``destination`` (the partition), counted when that is the host."""
        if self.host:
            self.counts.down_copies += 1
            self.counts.down_bytes += source.numel() * source.element_size()
        destination.copy_(source)

    def to_host(self, source: torch.Tensor) -> torch.Tensor:
        """A host copy of ``source`` (a device shard; on the CPU copied too: the same path)."""
        out = torch.empty(source.numel(), dtype=source.dtype, device="cpu")
        self.store(source.reshape(-1), out)
        return out

    # ---- page-locked staging buffers for shards read from NVMe ------------------------------------------
    def staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for an NVMe read of ``numel`` elements: a kept one whose last copy is done, else a
        new one (page-locked for an accelerator)."""
        free = self._staging.get((numel, dtype))
        if free:
            buffer, event = free.pop()
            if event is not None:
                event.synchronize()  # its last copy up has read it
            return buffer
        return host_buffer(numel, dtype, self.device)

    def done_with(self, buffer: torch.Tensor) -> None:
        """``buffer`` (from `staging`) may be reused once the copies issued from it so far are done."""
        event = None
        if self._stream is not None:
            accelerator = ds_ops.get_accelerator()
            event = accelerator.Event()
            event.record(accelerator.current_stream(self.device))
        self._staging.setdefault((buffer.numel(), buffer.dtype), []).append((buffer, event))

    def clear(self) -> None:
        self._staging.clear()
