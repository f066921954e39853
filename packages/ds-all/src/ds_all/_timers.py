"""Wall-clock timers of the engine (``wall_clock_breakdown``): named, started and stopped around each
phase, read in milliseconds as DeepSpeed's ``engine.timers(name).elapsed(reset)`` is (ds-profiler reads
``fwd``, ``bwd`` and ``step`` that way).

On a device whose work runs asynchronously (CUDA), a host clock measures the launch of the work, not the
work. With ``wall_clock_breakdown`` on such a device the timers record events on the device's stream
instead (DeepSpeed's ``SynchronizedWallClockTimer`` with its ``CudaEventTimer``s), through ds-ops'
accelerator seam, and read them once they are done. On the CPU (no events: the seam's ``Event`` is None)
they read the host's clock, as always.
"""

from __future__ import annotations

import time
from typing import Any

import ds_ops

FORWARD, BACKWARD, STEP, ALLREDUCE = "fwd", "bwd", "step", "allreduce"


def _event_class(accelerator: Any = None) -> Any:
    """The accelerator's timing event class, or None where the host's clock times the work (the CPU)."""
    accelerator = ds_ops.get_accelerator() if accelerator is None else accelerator
    if accelerator.use_host_timers():
        return None
    return accelerator.Event  # None where the accelerator has no events


class Timer:
    """One named timer: ``start()``/``stop()`` add up intervals; ``elapsed(reset)`` in milliseconds.
    ``event``: the device's event class (``Event(enable_timing=True)``, ``record()``, ``query()``,
    ``synchronize()``, ``elapsed_time(end)`` in milliseconds); None: the host's clock."""

    def __init__(self, name: str, event: Any = None) -> None:
        self.name = name
        self._event = event
        self._total = 0.0  # seconds of the intervals read so far
        self._started: Any = None  # a host time, or a start event
        self._recorded: list[tuple[Any, Any]] = []  # intervals of events not read yet

    def _now(self) -> Any:
        if self._event is None:
            return time.perf_counter()
        event = self._event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        if self._started is not None:
            raise RuntimeError(f"timer {self.name!r} is already running")
        self._started = self._now()

    def stop(self) -> None:
        if self._started is None:
            raise RuntimeError(f"timer {self.name!r} is not running")
        if self._event is None:
            self._total += time.perf_counter() - self._started
        else:
            self._recorded.append((self._started, self._now()))
            self._read(wait=False)  # what is done already: the list stays short without waiting
        self._started = None

    def _read(self, wait: bool) -> None:
        """Add the recorded intervals whose end event is done (``wait``: all of them, waiting for the
        device)."""
        pending = []
        for begin, end in self._recorded:
            if wait:
                end.synchronize()
            elif pending or not end.query():  # in stream order: the first not done keeps the rest
                pending.append((begin, end))
                continue
            self._total += begin.elapsed_time(end) / 1000.0
        self._recorded = pending

    def add(self, seconds: float) -> None:
        """Count an interval measured elsewhere (the reductions' wait, timed by ds-zero)."""
        self._total += seconds

    def elapsed(self, reset: bool = True) -> float:
        """Milliseconds counted so far (a running interval up to now included); ``reset`` zeroes them.
        With device events this waits for the device's work timed so far."""
        if self._event is not None:  # DeepSpeed's: a running timer stops, is read, starts again
            running = self._started is not None
            if running:
                self.stop()
            self._read(wait=True)
            total = self._total
            if reset:
                self._total = 0.0
            if running:
                self.start()
            return total * 1000.0
        total = self._total + (time.perf_counter() - self._started if self._started is not None else 0.0)
        if reset:
            self._total = 0.0
            if self._started is not None:
                self._started = time.perf_counter()
        return total * 1000.0


class Timers:
    """The engine's timers by name: ``timers("fwd").start()``. ``device_events``: time with the
    accelerator's events where it has them (``wall_clock_breakdown`` on a GPU); else the host's clock."""

    def __init__(self, device_events: bool = False, accelerator: Any = None) -> None:
        self._timers: dict[str, Timer] = {}
        self._event = _event_class(accelerator) if device_events else None

    def __call__(self, name: str) -> Timer:
        if name not in self._timers:
            self._timers[name] = Timer(name, self._event)
        return self._timers[name]

    def elapsed_all(self) -> dict[str, float]:
        """Every timer's milliseconds so far, by name (none reset)."""
        return {name: timer.elapsed(reset=False) for name, timer in self._timers.items()}

    def line(self, names: list[str], steps: int) -> str:
        """``time (ms) | fwd: 12.34 | ...``: the mean per optimizer step of each timer over the last
        ``steps`` steps (then reset)."""
        steps = max(steps, 1)
        return "time (ms) | " + " | ".join(f"{name}: {self(name).elapsed(reset=True) / steps:.2f}" for name in names)
