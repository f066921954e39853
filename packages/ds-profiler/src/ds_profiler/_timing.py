"""Module latency clocks, one per kind of device.

* CPU: ``time.perf_counter`` around the module's forward.
* CUDA: a pair of CUDA events per call, recorded on the current stream and read once, after one
  synchronisation, when the profile is read. The forward runs as asynchronously as without the
  profiler and a module's time is the device time between its start and its end.
* Any other accelerator: synchronise, then ``perf_counter``, on both sides of the forward.
"""

from __future__ import annotations

import time

import torch


class CpuClock:
    def start(self):
        return time.perf_counter()

    def stop(self, token, *records) -> None:
        elapsed = time.perf_counter() - token
        for record in records:
            record.duration += elapsed

    def resolve(self, records) -> None:
        pass


class CudaClock:
    def __init__(self) -> None:
        self._pending: list = []

    def start(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, token, *records) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((records, token, end))

    def resolve(self, records) -> None:
        if not self._pending:
            return
        torch.cuda.synchronize()
        for records, start, end in self._pending:
            elapsed = start.elapsed_time(end) / 1000.0
            for record in records:
                record.duration += elapsed
        self._pending.clear()


class SyncClock:
    """Devices without events we can rely on: synchronise on both sides."""

    def __init__(self, device_type: str) -> None:
        self._device_type = device_type

    def _sync(self) -> None:
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and hasattr(accelerator, "synchronize"):
            accelerator.synchronize()
        else:
            module = getattr(torch, self._device_type, None)
            if module is not None and hasattr(module, "synchronize"):
                module.synchronize()

    def start(self):
        self._sync()
        return time.perf_counter()

    def stop(self, token, *records) -> None:
        self._sync()
        elapsed = time.perf_counter() - token
        for record in records:
            record.duration += elapsed

    def resolve(self, records) -> None:
        pass


def clock_for(device_type: str):
    if device_type == "cpu" or device_type == "meta":
        return CpuClock()
    if device_type == "cuda":
        return CudaClock()
    return SyncClock(device_type)
