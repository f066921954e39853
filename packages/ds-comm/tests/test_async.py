"""Async ops stay async, with the comms logger off, on, and with hang diagnosis, on real gloo ranks."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ds_comm
import ds_comm.logger
from ds_comm.testing import spawn

OFF = {"enabled": False, "debug": False, "hang_timeout": None, "verbose": False}
ON = {**OFF, "enabled": True}
HANG = {**OFF, "enabled": True, "debug": True, "hang_timeout": 5}  # short: the old code blocked this long


def _data(rank: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * (rank + 1) + rank


def batch_p2p_in_every_mode(rank, world):
    right, left = (rank + 1) % world, (rank - 1) % world
    results = {}
    for name, config in (("off", OFF), ("on", ON), ("hang", HANG)):
        ds_comm.configure(config)
        ds_comm.comms_logger.reset()
        received = torch.empty(6)
        works = ds_comm.batch_isend_irecv([ds_comm.P2POp(dist.isend, _data(rank, 6), right),
                                           ds_comm.P2POp(dist.irecv, received, left)])
        assert isinstance(works, list) and len(works) == 2, works
        for work in works:
            work.wait()
        assert all(work.is_completed() for work in works)
        results[name] = (torch.equal(received, _data(left, 6)),
                         [(r.op, r.msg_bytes, r.count) for r in ds_comm.comms_logger.records()])
    ds_comm.configure(OFF)
    return results


def test_batch_isend_irecv_returns_one_work_per_op_with_the_logger_off_on_and_diagnosing():
    for results in spawn(batch_p2p_in_every_mode, world_size=2):
        assert {name: ok for name, (ok, _) in results.items()} == {"off": True, "on": True, "hang": True}
        assert results["off"][1] == []
        assert results["on"][1] == [("batch_isend_irecv", 48, 1)]  # the batch is one op: 2 × 6 floats
        assert results["hang"][1] == [("batch_isend_irecv", 48, 1)]


def _held_back_op(rank, config, issue):
    """Rank 1 holds back until rank 0 has looked at its handle, so rank 0's op cannot be done yet."""
    store = dist.distributed_c10d._get_default_store()
    ds_comm.configure(config)
    key = f"go-{config['hang_timeout']}-{config['enabled']}-{issue.__name__}"
    seen = {}
    if rank == 1:
        store.wait([key], timedelta(seconds=30))
    start = time.monotonic()
    work, check = issue(rank)
    seen["issue_s"] = time.monotonic() - start
    if rank == 0:
        seen["done_before_peer"] = work.is_completed()
        start = time.monotonic()
        try:
            work.wait(timedelta(seconds=0.3))
            seen["wait_timed_out"] = False
        except RuntimeError as e:
            seen["wait_timed_out"] = "timed out" in str(e).lower()
        seen["wait_s"] = time.monotonic() - start
        store.set(key, "1")
    deadline = time.monotonic() + 30
    while not work.is_completed():  # done without wait(): is_completed() sees the whole op through
        assert time.monotonic() < deadline, "is_completed() never became true"
        time.sleep(0.005)
    seen["result_ok_before_wait"] = check()
    work.wait()
    seen["result_ok"] = check()
    ds_comm.configure(OFF)
    return seen


def issue_all_reduce(rank):
    t = _data(rank, 16)
    return ds_comm.all_reduce(t, async_op=True), lambda: torch.equal(t, _data(0, 16) + _data(1, 16))


def issue_coalesced(rank):  # separate tensors: staged, reduced, copied back (a composite handle)
    a, b = _data(rank, 5), _data(rank, 7).double()
    return (ds_comm.all_reduce_coalesced([a, b], async_op=True),
            lambda: torch.equal(a, _data(0, 5) + _data(1, 5)) and torch.equal(b, (_data(0, 7) + _data(1, 7)).double()))


def issue_reduce_scatter(rank):
    out = torch.empty(8)
    full = _data(0, 16) + _data(1, 16)
    return (ds_comm.reduce_scatter_tensor(out, _data(rank, 16), async_op=True),
            lambda: torch.equal(out, full.chunk(2)[rank]))


def async_handles(rank, world):
    results = []
    for config in (OFF, ON, HANG):
        for issue in (issue_all_reduce, issue_coalesced, issue_reduce_scatter):
            results.append((issue.__name__, config["enabled"], config["hang_timeout"], _held_back_op(rank, config, issue)))
    return results


def test_async_handles_complete_on_their_own_and_honour_wait_timeouts():
    """is_completed() is false while the peer holds back and becomes true without wait() once
    the whole op (copy-back, local reduction included) is done; wait(timeout) raises after its
    timeout; with hang_timeout an async op is issued without blocking."""
    rank0, rank1 = spawn(async_handles, world_size=2, timeout=240)
    for name, enabled, hang, seen in rank0:
        where = f"{name} logger={enabled} hang_timeout={hang}"
        assert seen["issue_s"] < 2.0, where  # not blocked until the peer arrives
        assert seen["done_before_peer"] is False, where
        assert seen["wait_timed_out"] is True, where
        assert seen["wait_s"] < 2.0, where
        assert seen["result_ok_before_wait"] and seen["result_ok"], where
    for name, enabled, hang, seen in rank1:
        assert seen["result_ok_before_wait"] and seen["result_ok"], f"{name} logger={enabled} hang_timeout={hang}"


def async_time_is_communication_only(rank, world):
    ds_comm.configure(ON)
    ds_comm.comms_logger.reset()
    ds_comm.barrier()
    work = ds_comm.all_reduce(torch.ones(1024), async_op=True)
    time.sleep(1.0)  # compute overlapping the communication
    work.wait()
    work = ds_comm.reduce_scatter_tensor(torch.empty(512), torch.ones(1024), async_op=True)
    time.sleep(1.0)
    work.wait()
    records = {r.op: r.total_s for r in ds_comm.comms_logger.records()}
    ds_comm.configure(OFF)
    return records


def test_the_logger_times_an_async_op_to_its_completion_not_to_wait():
    for records in spawn(async_time_is_communication_only, world_size=2):
        assert set(records) >= {"all_reduce", "reduce_scatter_tensor"}
        assert records["all_reduce"] < 0.5, records  # was ≥ 1 s: the compute counted as communication
        assert records["reduce_scatter_tensor"] < 0.5, records


class _CountingStore:
    def __init__(self, store):
        self.store, self.calls = store, 0

    def __getattr__(self, name):
        self.calls += 1
        return getattr(self.store, name)


def store_calls_per_collective(rank, world):
    counting = _CountingStore(dist.distributed_c10d._get_default_store())
    ds_comm.logger._store = lambda: counting
    counts = {}
    for name, config in (("debug", {**OFF, "debug": True}), ("hang", {**OFF, "debug": True, "hang_timeout": 30})):
        ds_comm.configure(config)
        counting.calls = 0
        for _ in range(200):
            ds_comm.all_reduce(torch.ones(4))
        ds_comm.configure(OFF)  # stops the publisher thread
        counts[name] = counting.calls
    return counts


def test_debug_numbers_collectives_without_a_store_round_trip_each():
    for counts in spawn(store_calls_per_collective, world_size=2):
        assert counts["debug"] == 0  # numbered in memory only
        assert counts["hang"] <= 10  # a background publisher, a handful of sets (was 200)
