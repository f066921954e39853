"""The comms logger: per-op counts, latency and bandwidth; verbose lines; hang diagnosis.

Off by default, and then a collective costs one attribute check. When on, each recorded op is
timed around its completion (with a device synchronisation for CUDA tensors) and kept per op and
message size. With ``debug`` every rank numbers the collectives of each group and publishes its
latest number in the process group's store; with ``hang_timeout`` a collective that has not
completed in time is diagnosed from those numbers and raised as `CollectiveHang`.
"""

from __future__ import annotations

import inspect
import json
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import CommsLoggerConfig

HISTORY = 8  # the last ops each rank reports when a collective hangs

# Bus-bandwidth factors (as nccl-tests defines them): the share of the message each rank sends.
_RING_ALL_REDUCE = {"all_reduce", "all_reduce_coalesced"}
_ONE_OF_N = {"all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"}


def bus_factor(op: str, world_size: int) -> float:
    n = max(world_size, 1)
    if op in _RING_ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if op in _ONE_OF_N:
        return (n - 1) / n
    if op in ("barrier", "monitored_barrier"):
        return 0.0
    return 1.0


class CollectiveHang(TimeoutError):
    """A collective did not complete within ``comms_logger.hang_timeout``; the message says which
    rank is out of step and what each rank did last."""


@dataclass
class OpRecord:
    op: str
    msg_bytes: int
    count: int
    total_s: float
    world_size: int

    @property
    def avg_s(self) -> float:
        return self.total_s / self.count

    @property
    def algbw(self) -> float:
        return self.msg_bytes / self.avg_s if self.avg_s > 0 else 0.0

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.op, self.world_size)

    @property
    def bus_bytes(self) -> float:
        """Bytes this rank sent for these ops (message size × bus factor × count)."""
        return self.msg_bytes * bus_factor(self.op, self.world_size) * self.count

    def as_dict(self) -> dict:
        return {"op": self.op, "msg_bytes": self.msg_bytes, "count": self.count, "total_s": self.total_s,
                "avg_s": self.avg_s, "algbw": self.algbw, "busbw": self.busbw, "bus_bytes": self.bus_bytes}


class _TimedWork:
    """An async op's handle that records the op when it is waited for."""

    def __init__(self, work, finish: Callable[[], None]):
        self._work, self._finish = work, finish

    def wait(self, timeout: timedelta | None = None):
        result = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._finish()
        return result

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def __getattr__(self, name):
        return getattr(self._work, name)


class CommsLogger:
    def __init__(self):
        self.config = CommsLoggerConfig()
        self._times: dict[tuple[str, int, int], list[float]] = defaultdict(list)
        self._sequences: dict[str, int] = defaultdict(int)
        self._history: deque = deque(maxlen=HISTORY)
        self.active = False

    # ---- configuration --------------------------------------------------------------------------
    def configure(self, config=None, **overrides) -> CommsLoggerConfig:
        if config is None:
            config = self.config.model_dump()
        elif isinstance(config, CommsLoggerConfig):
            config = config.model_dump()
        else:
            config = dict(config.get("comms_logger", config)) if isinstance(config, dict) else config
        self.config = CommsLoggerConfig.model_validate({**config, **overrides})
        if self.config.hang_timeout is not None and not self.config.debug:
            raise ValueError("comms_logger.hang_timeout needs comms_logger.debug=true "
                             "(the diagnosis compares the ranks' collective sequence numbers)")
        self.active = self.config.enabled or self.config.debug
        return self.config

    def reset(self) -> None:
        self._times.clear()
        self._history.clear()

    def reset_sequences(self) -> None:
        self._sequences.clear()

    # ---- running an op ----------------------------------------------------------------------------
    def run(self, op: str, msg_bytes: int, group, tensors, call: Callable[[bool], object], async_op: bool):
        """Run ``call(async_op)`` (the collective), recording and diagnosing it as configured."""
        cfg = self.config
        caller = _caller() if cfg.debug else ""
        seq = self._publish(op, msg_bytes, group, caller) if cfg.debug else None
        record = cfg.enabled and (cfg.prof_all or op in cfg.prof_ops)
        cuda = record and any(t.is_cuda for t in tensors)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()

        def finish():
            if cuda:
                torch.cuda.synchronize()
            if record:
                self._record(op, msg_bytes, group, time.perf_counter() - start, caller)

        if cfg.hang_timeout is not None:
            work = call(True)
            if work is not None:
                self._wait_or_diagnose(work, op, group, seq)
            finish()
            return work if async_op else None
        result = call(async_op)
        if async_op and result is not None:
            return _TimedWork(result, finish)
        finish()
        return result

    def _record(self, op: str, msg_bytes: int, group, seconds: float, caller: str) -> None:
        world = dist.get_world_size(group)
        self._times[(op, msg_bytes, world)].append(seconds)
        if self.config.verbose:
            algbw = msg_bytes / seconds if seconds > 0 else 0.0
            line = (f"ds_comm | rank {dist.get_rank()} | {op} | {_size(msg_bytes)} | {seconds * 1e3:.3f} ms | "
                    f"algbw {algbw / 1e9:.2f} GB/s | busbw {algbw * bus_factor(op, world) / 1e9:.2f} GB/s")
            print(line + (f" | {caller}" if caller else ""), flush=True)

    # ---- hang diagnosis -------------------------------------------------------------------------------
    def _publish(self, op: str, msg_bytes: int, group, caller: str) -> int:
        key = _group_key(group)
        self._sequences[key] += 1
        seq = self._sequences[key]
        entry = {"seq": seq, "op": op, "bytes": msg_bytes, "caller": caller}
        self._history.append({**entry, "group": key})
        _store().set(f"ds_comm/seq/{key}/{dist.get_rank()}", json.dumps(entry))
        return seq

    def _wait_or_diagnose(self, work, op: str, group, seq: int) -> None:
        timeout = self.config.hang_timeout
        try:
            completed = work.wait(timedelta(seconds=timeout))
        except RuntimeError as e:
            if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                raise
            completed = False
        if completed is False:
            raise CollectiveHang(self._diagnose(op, group, seq, timeout)) from None

    def _diagnose(self, op: str, group, seq: int, timeout: float) -> str:
        key = _group_key(group)
        me = dist.get_rank()
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        store = _store()
        positions = {}
        for rank in ranks:
            name = f"ds_comm/seq/{key}/{rank}"
            positions[rank] = json.loads(store.get(name)) if store.check([name]) else None
        behind = [r for r, p in positions.items() if p is None or p["seq"] < seq]
        ahead = [r for r, p in positions.items() if p is not None and p["seq"] > seq]

        def where(rank):
            p = positions[rank]
            if p is None:
                return f"rank {rank}: no collective on this group yet"
            return f"rank {rank}: at {p['op']} #{p['seq']}" + (f" (from {p['caller']})" if p["caller"] else "")

        lines = [f"ds_comm: {op} #{seq} on group {key} did not complete within {timeout:g} s on rank {me}."]
        if behind:
            lines.append(f"rank(s) {behind} never reached {op} #{seq}: they skipped it or are stuck before it.")
        if ahead:
            lines.append(f"rank(s) {ahead} are past #{seq}: they ran a collective this rank did not.")
        if not behind and not ahead:
            lines.append("every rank reached this collective: the hang is inside it (network, deadlock in the backend).")
        lines.append("where each rank is: " + "; ".join(where(r) for r in ranks))
        lines.append("this rank's last ops: " + ", ".join(f"{h['op']} #{h['seq']} [{h['group']}]" for h in self._history))
        lines.append("the process group cannot be trusted after this; restart the job")
        return "\n".join(lines)

    # ---- summary --------------------------------------------------------------------------------------
    def records(self) -> list[OpRecord]:
        return [OpRecord(op, size, len(times), sum(times), world)
                for (op, size, world), times in sorted(self._times.items())]

    def log_summary(self, show_straggler: bool = False) -> list[dict]:
        """Print (rank 0) and return the per-op, per-size summary. With ``show_straggler`` every rank
        must call it: the slowest and fastest rank's total latency are gathered per op and size."""
        rows = [r.as_dict() for r in self.records()]
        if show_straggler:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, {(r["op"], r["msg_bytes"]): r["total_s"] for r in rows})
            for row in rows:
                totals = [d.get((row["op"], row["msg_bytes"]), 0.0) for d in everyone]
                row["straggler_s"] = max(totals) - min(totals)
        if not dist.is_initialized() or dist.get_rank() == 0:
            header = f"{'op':<24}{'size':>10}{'count':>8}{'total ms':>11}{'avg ms':>9}{'algbw GB/s':>12}{'busbw GB/s':>12}"
            print(header + ("  straggler ms" if show_straggler else ""))
            for row in rows:
                line = (f"{row['op']:<24}{_size(row['msg_bytes']):>10}{row['count']:>8}{row['total_s'] * 1e3:>11.3f}"
                        f"{row['avg_s'] * 1e3:>9.3f}{row['algbw'] / 1e9:>12.3f}{row['busbw'] / 1e9:>12.3f}")
                print(line + (f"{row['straggler_s'] * 1e3:>14.3f}" if show_straggler else ""))
        return rows


def _store():
    return dist.distributed_c10d._get_default_store()


def _group_key(group) -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    return "ranks-" + "-".join(map(str, dist.get_process_group_ranks(group)))


def _caller() -> str:
    frame = inspect.currentframe()
    while frame is not None and frame.f_globals.get("__package__") == __package__:
        frame = frame.f_back
    return f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})" if frame else ""


def _size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes} B"


comms_logger = CommsLogger()
