"""Wall-clock timers of the engine (``wall_clock_breakdown``): named, started and stopped around each
phase, read in milliseconds as DeepSpeed's ``engine.timers(name).elapsed(reset)`` is (ds-profiler reads
``fwd``, ``bwd`` and ``step`` that way)."""

from __future__ import annotations

import time

FORWARD, BACKWARD, STEP, ALLREDUCE = "fwd", "bwd", "step", "allreduce"


class Timer:
    """One named timer: ``start()``/``stop()`` add up intervals; ``elapsed(reset)`` in milliseconds."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._total = 0.0
        self._started: float | None = None

    def start(self) -> None:
        if self._started is not None:
            raise RuntimeError(f"timer {self.name!r} is already running")
        self._started = time.perf_counter()

    def stop(self) -> None:
        if self._started is None:
            raise RuntimeError(f"timer {self.name!r} is not running")
        self._total += time.perf_counter() - self._started
        self._started = None

    def add(self, seconds: float) -> None:
        """Count an interval measured elsewhere (the reductions' wait, timed by ds-zero)."""
        self._total += seconds

    def elapsed(self, reset: bool = True) -> float:
        """Milliseconds counted so far (a running interval up to now included); ``reset`` zeroes them."""
        total = self._total + (time.perf_counter() - self._started if self._started is not None else 0.0)
        if reset:
            self._total = 0.0
            if self._started is not None:
                self._started = time.perf_counter()
        return total * 1000.0


class Timers:
    """The engine's timers by name: ``timers("fwd").start()``."""

    def __init__(self) -> None:
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        if name not in self._timers:
            self._timers[name] = Timer(name)
        return self._timers[name]

    def elapsed_all(self) -> dict[str, float]:
        """Every timer's milliseconds so far, by name (none reset)."""
        return {name: timer.elapsed(reset=False) for name, timer in self._timers.items()}

    def line(self, names: list[str], steps: int) -> str:
        """``time (ms) | fwd: 12.34 | ...``: the mean per optimizer step of each timer over the last
        ``steps`` steps (then reset)."""
        steps = max(steps, 1)
        return "time (ms) | " + " | ".join(f"{name}: {self(name).elapsed(reset=True) / steps:.2f}" for name in names)
