"""The CUDA clock's bookkeeping, with stand-in events on the CPU: an event pair per timed call,
recorded on the stream without synchronising, read after one synchronisation when the profile is
read, each record credited with its own pair's elapsed time."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import torch

from ds_profiler import _timing


def test_the_cuda_clock_reads_its_events_once_after_one_synchronisation(monkeypatch):
    clock_ticks, syncs, recorded = itertools.count(), [], []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self, stream=None):
            self.at = next(clock_ticks)
            recorded.append(self)

        def elapsed_time(self, end):
            assert syncs, "read before synchronising"
            return float(end.at - self.at) * 1000.0  # ms: 1 s per tick

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    clock = _timing.clock_for("cuda")
    assert isinstance(clock, _timing.CudaClock)
    outer, inner = SimpleNamespace(duration=0.0), SimpleNamespace(duration=0.0)
    a = clock.start()  # tick 0
    b = clock.start()  # tick 1
    clock.stop(b, inner)  # tick 2: inner 1 s
    clock.stop(a, outer, inner)  # tick 3: outer 3 s, inner 3 s more
    assert len(recorded) == 4 and not syncs and outer.duration == 0.0  # nothing read yet
    clock.resolve([outer, inner])
    assert len(syncs) == 1 and (outer.duration, inner.duration) == (3.0, 4.0)
    clock.resolve([outer, inner])  # read once: no second synchronisation, nothing added
    assert len(syncs) == 1 and (outer.duration, inner.duration) == (3.0, 4.0)


def test_cpu_and_meta_use_host_timers_and_other_devices_synchronise():
    assert isinstance(_timing.clock_for("cpu"), _timing.CpuClock)
    assert isinstance(_timing.clock_for("meta"), _timing.CpuClock)
    assert isinstance(_timing.clock_for("xpu"), _timing.SyncClock)
