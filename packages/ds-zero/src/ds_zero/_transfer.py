"""The host <-> device copy engine of ZeRO-Offload: plain functions with explicit arguments.

A gradient shard goes device -> host once its reduction has landed (`device_to_host`: on a side copy
stream that first waits for an event recorded on the current stream, so the copy is ordered after the
reduction and overlaps the rest of backward); `wait_copies` makes the host wait for them before the CPU
Adam reads the host buffer. The new parameters go host -> device (`host_to_device`, non-blocking from
pinned memory, on the current stream: the all-gather that follows is ordered after it) and an event
recorded after them keeps the host buffer from being rewritten before the copies have read it.

Where the accelerator has no streams (the CPU) every function does the same copies synchronously,
between separate tensors, so CPU CI runs the same path; only the overlap is lost. `TransferCounts`
counts the copies and bytes in each direction (the tests read it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import ds_ops


@dataclass
class TransferCounts:
    """Copies and bytes moved each way since the counter was made (or `reset`)."""

    down_copies: int = 0  # device -> host
    down_bytes: int = 0
    up_copies: int = 0  # host -> device
    up_bytes: int = 0

    def reset(self) -> None:
        self.down_copies = self.down_bytes = self.up_copies = self.up_bytes = 0


def _accelerator(device: torch.device) -> Any:
    """The accelerator whose streams order copies to and from ``device``; None for the CPU (no streams)."""
    if device.type == "cpu":
        return None
    accelerator = ds_ops.get_accelerator()
    return accelerator if accelerator.Stream is not None else None


def host_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed host tensor that meets ``device`` in copies: page-locked where ``device`` is an
    accelerator (asynchronous copies need it), plain memory for a CPU model."""
    out = torch.zeros(numel, dtype=dtype, device="cpu")
    return ds_ops.get_accelerator().pin_memory(out) if device.type != "cpu" else out


def copy_stream(device: torch.device) -> Any:
    """A side stream for copies on ``device``; None for the CPU."""
    accelerator = _accelerator(device)
    return accelerator.Stream(device=device) if accelerator is not None else None


def device_to_host(source: torch.Tensor, destination: torch.Tensor, *, stream: Any, counts: TransferCounts) -> Any:
    """Copy ``source`` (on the device) into ``destination`` (host) after the work issued so far on the
    current stream (the reduction that wrote ``source``): on ``stream``, non-blocking; synchronously
    where ``stream`` is None. Returns the event that marks the copy's end (None without streams)."""
    counts.down_copies += 1
    counts.down_bytes += source.numel() * source.element_size()
    if stream is None:
        destination.copy_(source)
        return None
    accelerator = ds_ops.get_accelerator()
    ready = accelerator.Event()
    ready.record()  # on the current stream, after the reduction
    stream.wait_event(ready)
    with accelerator.stream(stream):
        destination.copy_(source, non_blocking=True)
        done = accelerator.Event()
        done.record(stream)
    return done


def host_to_device(source: torch.Tensor, destination: torch.Tensor, *, counts: TransferCounts) -> None:
    """Copy ``source`` (host, pinned on an accelerator) into ``destination`` (on the device), non-blocking,
    on the current stream (what is issued after it on that stream sees the new values)."""
    counts.up_copies += 1
    counts.up_bytes += source.numel() * source.element_size()
    destination.copy_(source, non_blocking=destination.device.type != "cpu")


def record_event(device: torch.device) -> Any:
    """An event recorded on the current stream of ``device`` (None for the CPU: the copies are done)."""
    accelerator = _accelerator(device)
    if accelerator is None:
        return None
    event = accelerator.Event()
    event.record()
    return event


def wait_copies(events: list[Any]) -> None:
    """Block the host until each copy marked by ``events`` is done (Nones, the CPU's, are done)."""
    for event in events:
        if event is not None:
            event.synchronize()
