"""ds-comm's CUDA path, as far as a CPU runs it: the backend choice (nccl on a GPU, gloo without,
``dist_backend`` winning, LOCAL_RANK's device), the comms logger's CUDA-event timing (driven here
by stand-in events: recorded around the op, read only when the records are asked for), the NCCL
watchdog check of the hang diagnosis. The ``cuda``-marked tests run them on a GPU over NCCL at
world size 1."""

from __future__ import annotations

import itertools
import logging
from datetime import timedelta

import pytest
import torch

import ds_comm
import ds_comm.logger
from ds_comm import distributed
from ds_comm.testing import spawn

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ON = {"enabled": True, "debug": False, "hang_timeout": None, "verbose": False}


@pytest.mark.parametrize("gpu, asked, expected", [(True, None, "nccl"), (False, None, "gloo"), (True, "gloo", "gloo"),
                                                  (False, "nccl", "nccl"), (True, "mpi", "mpi")])
def test_the_backend_is_nccl_on_a_gpu_gloo_without_and_dist_backend_wins(monkeypatch, gpu, asked, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert distributed._default_backend(asked) == expected


@pytest.mark.parametrize("gpu, asked, local_rank, devices, backend, device", [
    (True, None, "3", 2, "nccl", 1),  # LOCAL_RANK 3 on a node of 2 GPUs: GPU 1
    (True, None, "0", 8, "nccl", 0),
    (True, "gloo", "3", 2, "gloo", None),  # gloo asked for: no GPU is claimed
    (False, None, "1", 0, "gloo", None),
])
def test_init_distributed_picks_the_backend_and_the_local_ranks_gpu(monkeypatch, gpu, asked, local_rank, devices,
                                                                    backend, device):
    made, chosen = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend, **kw: made.append((backend, kw)))
    monkeypatch.setattr(distributed, "_register_exit_hook", lambda: None)
    monkeypatch.setattr(distributed, "_group_timeout", None)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    ds_comm.init_distributed(dist_backend=asked, timeout=timedelta(minutes=3))
    assert [(b, kw["timeout"], kw["rank"], kw["world_size"]) for b, kw in made] == [(backend, timedelta(minutes=3), 0, 1)]
    assert chosen == ([] if device is None else [device])
    assert distributed._group_timeout == timedelta(minutes=3)


def test_a_hang_timeout_nccls_watchdog_would_preempt_is_warned_about(monkeypatch, caplog):
    monkeypatch.setattr(ds_comm.logger, "_on_nccl", lambda group: True)
    monkeypatch.setattr(distributed, "_group_timeout_now", lambda: timedelta(seconds=60))
    with caplog.at_level(logging.WARNING, logger="ds_comm.logger"):
        ds_comm.logger._check_watchdog(30.0)
        assert not caplog.records
        ds_comm.logger._check_watchdog(60.0)
    assert "hang_timeout (60 s) is not below the process group's timeout (60 s)" in caplog.text
    caplog.clear()
    monkeypatch.setattr(ds_comm.logger, "_on_nccl", lambda group: False)  # gloo: no watchdog
    with caplog.at_level(logging.WARNING, logger="ds_comm.logger"):
        ds_comm.logger._check_watchdog(600.0)
    assert not caplog.records


class _Event:
    """A stand-in CUDA event: its time is the order of its recording (1 ms apart)."""

    clock = itertools.count()
    made: list[_Event] = []
    reads = 0

    def __init__(self, device):
        self.device, self.at = device, next(self.clock)
        self.made.append(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _Event) -> float:
        type(self).reads += 1
        return float(end.at - self.at)


def events_time_the_ops(rank, world):
    """Every tensor counts as a CUDA one; the events are stand-ins with a known clock."""
    ds_comm.logger._cuda_device = lambda tensors: torch.device("cpu") if tensors else None
    ds_comm.logger._record_event = _Event
    ds_comm.configure(ON)
    ds_comm.comms_logger.reset()
    t = torch.ones(4)
    ds_comm.all_reduce(t)  # blocking: events 0 (before the issue) and 1 (after it), 1 ms
    after_blocking = (len(_Event.made), _Event.reads)
    work = ds_comm.all_reduce(t, async_op=True)  # async: event 2 at the issue ...
    after_issue = len(_Event.made)
    _Event(None)  # ... other work recorded on the stream meanwhile (event 3) ...
    work.wait()  # ... event 4 at the wait: 2 ms
    after_wait = (len(_Event.made), _Event.reads)
    records = [(r.op, r.msg_bytes, r.count, round(r.total_s * 1e3, 6)) for r in ds_comm.comms_logger.records()]
    read = _Event.reads
    ds_comm.configure({**ON, "verbose": True})
    ds_comm.all_reduce(t)  # verbose: the line needs the time at once
    verbose_reads = _Event.reads - read
    ds_comm.configure({**ON, "debug": True, "hang_timeout": 30})
    ds_comm.comms_logger.reset()
    ds_comm.all_reduce(t)  # issued async and waited with the diagnosis: still two events, 1 ms
    diagnosed = [(r.count, round(r.total_s * 1e3, 6)) for r in ds_comm.comms_logger.records()]
    ds_comm.configure({**ON, "enabled": False})
    return after_blocking, after_issue, after_wait, records, read, verbose_reads, diagnosed


def test_cuda_ops_are_timed_by_events_around_them_and_read_late():
    (result,) = spawn(events_time_the_ops, world_size=1)
    after_blocking, after_issue, after_wait, records, read, verbose_reads, diagnosed = result
    assert after_blocking == (2, 0)  # two events, nothing read (no synchronisation)
    assert after_issue == 3 and after_wait == (5, 0)
    assert records == [("all_reduce", 16, 2, 3.0)]  # 1 ms + 2 ms, read when asked for
    assert read == 2 and verbose_reads == 1
    assert diagnosed == [(1, 1.0)]


def test_a_cpu_op_is_timed_by_host_timers():
    assert ds_comm.logger._cuda_device([torch.ones(2)]) is None and ds_comm.logger._cuda_device([]) is None


# ---- on a GPU, over NCCL at world size 1 (scripts/gpu_check.sh) ------------------------------------------------

def nccl_logger_and_buckets(rank, world):
    assert torch.distributed.get_backend() == "nccl" and torch.cuda.current_device() == 0
    device = torch.device("cuda", torch.cuda.current_device())
    ds_comm.configure(ON)
    ds_comm.comms_logger.reset()
    big = torch.ones(1 << 24, device=device)
    ds_comm.all_reduce(big)
    work = ds_comm.all_reduce(big, async_op=True)
    work.wait()
    (record,) = ds_comm.comms_logger.records()
    flat = torch.arange(8, dtype=torch.float32, device=device)
    shard = torch.empty(8, device=device)
    ds_comm.reduce_scatter_bucket(flat, shard)
    gathered = torch.zeros(8, device=device)
    gathered.copy_(shard)
    ds_comm.all_gather_bucket(gathered)
    parts = [torch.ones(3, device=device), torch.full((5,), 2.0, device=device)]  # not one buffer: staged
    ds_comm.all_reduce_coalesced(parts)
    torch.cuda.synchronize()
    ds_comm.configure({**ON, "enabled": False})
    return (record.op, record.count, record.total_s, torch.equal(shard, flat), torch.equal(gathered, flat),
            [p.tolist() for p in parts], ds_comm.collectives._staging.held_bytes())


@pytest.mark.cuda
@cuda
def test_cuda_comms_logger_and_bucketed_collectives_over_nccl():
    (result,) = spawn(nccl_logger_and_buckets, world_size=1, backend="nccl")
    op, count, total_s, scattered, gathered, parts, held = result
    assert (op, count) == ("all_reduce", 2) and 0.0 < total_s < 10.0
    assert scattered and gathered
    assert parts == [[1.0] * 3, [2.0] * 5]
    assert held == 0  # CUDA staging buffers go back to torch's allocator, not to ds_comm's pool
