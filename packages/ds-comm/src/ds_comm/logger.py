"""The comms logger: per-op counts, latency and bandwidth; verbose lines; hang diagnosis.

Off by default, and then a collective costs one attribute check. When on, each recorded op is
timed from its issue to its own completion: a blocking op around the call, an async op by a
completion callback on its work (so compute between issue and ``wait()`` is not counted as
communication; where the backend has no callback, the op ends when it is first seen complete by
``wait()`` or ``is_completed()``). Times are kept per op and message size.

CUDA tensors are timed on the GPU, not by host timers (which would measure the launch): a CUDA
event is recorded on the current stream before the op is issued and another after it on the same
stream -- for a blocking op when the call returns (NCCL has made the stream wait for the
collective), for an async op at the ``wait()`` (or ``is_completed()``) that first sees it done. No
synchronisation on the way: the elapsed time is read when the records are asked for
(`CommsLogger.records`, `CommsLogger.log_summary`), or at once for a ``verbose`` line.

With ``debug`` every rank numbers the collectives of each group, in memory only. With
``hang_timeout`` a background thread also publishes the rank's latest numbers to the process
group's store, at most every ``min(1 s, hang_timeout / 4)`` and only when they changed; a collective
whose ``wait()`` runs past ``hang_timeout`` is diagnosed from those numbers and raised as
`CollectiveHang`, and the rank leaves at exit without waiting for the stuck peer. Async ops stay
async: the diagnosis happens in ``wait()``.

Output (verbose lines, the summary) goes through `logging` (logger ``ds_comm.logger``, level INFO);
when the application has configured no logging at all, it is written to stdout.
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from . import distributed as _distributed
from ._ops import P2P, bus_factor
from .config import CommsLoggerConfig
from .topology import node_topology

log = logging.getLogger(__name__)

HISTORY = 8  # the last ops each rank reports when a collective hangs
PUBLISH_INTERVAL_S = 1.0  # the longest a rank's published position may lag (and hang_timeout / 4)
PENDING_LIMIT = 1024  # CUDA-timed ops kept unread before the finished ones are read


class _StdoutIfUnconfigured(logging.Handler):
    """Writes this logger's lines to stdout (warnings and errors to stderr) when the application has
    configured no logging (the root logger has no handler), so that ``verbose`` and `log_summary`
    show without any setup. Once the application configures logging, its handlers decide and this
    one stays silent."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


log.setLevel(logging.INFO)  # records exist only when asked for (verbose, log_summary) or on trouble
log.addHandler(_StdoutIfUnconfigured())


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
    off_node_peers: int | None = None  # the group's ranks on another node than this one; None: point to point

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

    @property
    def cross_node_bytes(self) -> float | None:
        """Of `bus_bytes`, those addressed to ranks on other nodes (`ds_comm.node_topology`): each
        peer of the group gets an equal share (an all-gather's shard, an all-to-all's chunk, a
        reduce-scatter's chunk; an all-reduce counts as reduce-scatter + all-gather), so this is
        ``bus_bytes * off_node_peers / (world_size - 1)``: what a direct exchange sends across, whatever
        ring or tree the backend runs. None for point-to-point ops."""
        if self.off_node_peers is None:
            return None
        return self.bus_bytes * self.off_node_peers / (self.world_size - 1) if self.world_size > 1 else 0.0

    def as_dict(self) -> dict:
        return {"op": self.op, "msg_bytes": self.msg_bytes, "count": self.count, "total_s": self.total_s,
                "avg_s": self.avg_s, "algbw": self.algbw, "busbw": self.busbw, "bus_bytes": self.bus_bytes,
                "off_node_peers": self.off_node_peers, "cross_node_bytes": self.cross_node_bytes}


def _no_limit(timeout) -> bool:
    """torch's ``Work.wait`` takes ``timedelta(0)`` (its default) or None as "no limit"."""
    return timeout is None or (isinstance(timeout, timedelta) and timeout <= timedelta(0))


def _seconds(timeout) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def _timed_out(error: RuntimeError) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def _is_work(result) -> bool:
    return result is not None and callable(getattr(result, "wait", None))


@dataclass
class _Issued:
    """One issued op as the logger records it: plain values only, so that a completion callback
    holds no process group (a group kept alive keeps gloo's threads alive at exit)."""

    op: str
    msg_bytes: int
    world_size: int
    rank: int
    caller: str
    device: torch.device | None  # the CUDA device of the op's tensors: timed with events; None: host timers
    off_node_peers: int | None = None
    start: float = 0.0
    start_event: object = None
    end_event: object = None


class _Countdown:
    """Records an op when the last of its works (one, or a batch_isend_irecv's several) is seen done."""

    def __init__(self, logger: CommsLogger, issued: _Issued, works: int):
        self.logger, self.issued, self.left = logger, issued, works

    def one_done(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.logger._finish(self.issued)


class _LoggedWork:
    """The handle of an async op issued while the logger is on; anything but ``wait`` and
    ``is_completed`` goes to the backend's work. ``wait(timeout)`` honours its timeout; with
    ``hang_timeout`` a wait without a shorter limit of its own diagnoses a hang instead of hanging."""

    def __init__(self, logger: CommsLogger, work, op: str, group, key: str | None, seq: int | None,
                 countdown: _Countdown | None):
        self._logger, self._work, self._op, self._group, self._key, self._seq = logger, work, op, group, key, seq
        self._countdown = countdown  # set when the op is recorded on observation (no completion callback)

    def wait(self, timeout=None):
        hang = self._logger.config.hang_timeout
        if hang is not None and self._seq is not None and (_no_limit(timeout) or _seconds(timeout) >= hang):
            result = self._logger._wait_or_diagnose(self._work, self._op, self._group, self._key, self._seq, hang)
        else:
            result = self._work.wait() if _no_limit(timeout) else self._work.wait(timeout)
        self._seen_done()
        return result

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            self._seen_done()
        return done

    def _seen_done(self) -> None:
        if self._countdown is not None:
            countdown, self._countdown = self._countdown, None
            countdown.one_done()

    def __getattr__(self, name):
        return getattr(self._work, name)


class _Publisher:
    """A daemon thread that puts this rank's latest collective numbers into the store, when they
    changed, every ``interval`` seconds: the diagnosis of a hang reads them, and no collective pays
    a store round trip."""

    def __init__(self, logger: CommsLogger, store, rank: int, interval: float):
        self.logger, self.store, self.rank, self.interval = logger, store, rank, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds_comm-positions", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = None
        while True:
            try:
                last = self.logger._publish(self.store, self.rank, last)
            except Exception as e:  # the store is gone (teardown): nothing left to publish to
                log.debug("ds_comm: position publisher stops: %s", e)
                return
            if self._stop.wait(self.interval):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


class CommsLogger:
    def __init__(self):
        self.config = CommsLoggerConfig()
        self._times: dict[tuple[str, int, int, int | None], list[float]] = defaultdict(list)
        self._off_node: dict[tuple, int] = {}  # (group key, node layout) -> off-node peers of this rank
        self._sequences: dict[str, int] = {}
        self._positions: dict[str, dict] = {}  # group key -> this rank's latest collective on it
        self._history: deque = deque(maxlen=HISTORY)
        self._pending: deque = deque()  # CUDA-timed ops whose elapsed time is not read yet
        self._publisher: _Publisher | None = None
        self.active = False
        _distributed._on_teardown(self._on_teardown)

    # ---- configuration --------------------------------------------------------------------------
    def configure(self, config=None, **overrides) -> CommsLoggerConfig:
        # the section, a whole DeepSpeed config (dict or JSON path) holding it, or the current one
        base = self.config if config is None else CommsLoggerConfig.from_section_or_ds_config(config)
        new = CommsLoggerConfig.model_validate({**base.model_dump(), **overrides}) if overrides else base
        if new.hang_timeout is not None and not new.debug:
            raise ValueError("comms_logger.hang_timeout needs comms_logger.debug=true "
                             "(the diagnosis compares the ranks' collective sequence numbers)")
        self._stop_publisher()  # started again by the next collective if hang_timeout is set
        self.config = new
        self.active = new.enabled or new.debug
        return self.config

    def reset(self) -> None:
        self._times.clear()
        self._history.clear()
        self._pending.clear()

    def reset_sequences(self) -> None:
        self._off_node.clear()
        self._sequences.clear()
        self._positions.clear()

    def _on_teardown(self) -> None:
        self._stop_publisher()
        self.reset_sequences()

    # ---- running an op ----------------------------------------------------------------------------
    def run(self, op: str, msg_bytes: int, group, tensors, call: Callable[[bool], object], async_op: bool):
        """Run ``call(async_op)`` (the collective), recording and diagnosing it as configured."""
        cfg = self.config
        hang = cfg.hang_timeout
        caller = key = seq = None
        if cfg.debug:
            caller, key = _caller(), _group_key(group)
            seq = self._count(op, msg_bytes, key, caller)
            if hang is not None and self._publisher is None:
                _check_watchdog(hang)
                self._publisher = _Publisher(self, _store(), dist.get_rank(), min(PUBLISH_INTERVAL_S, hang / 4))
        record = cfg.enabled and (cfg.prof_all or op in cfg.prof_ops)
        issued = None
        if record:
            issued = _Issued(op, msg_bytes, dist.get_world_size(group), dist.get_rank(), caller or "",
                             _cuda_device(tensors), None if op in P2P else self._off_node_peers(group))
            if issued.device is not None:
                issued.start_event = _record_event(issued.device)
            issued.start = time.perf_counter()
        if async_op:
            return self._wrap(call(True), op, issued, group, key, seq)
        if hang is None or seq is None:
            result = call(False)
        else:  # issued async, waited here with the diagnosis
            result = call(True)
            works = result if isinstance(result, list) else [result] if _is_work(result) else []
            for work in works:
                self._wait_or_diagnose(work, op, group, key, seq, hang)
            if works:
                result = None
        if issued is not None:
            self._finish(issued)
        return result

    def _wrap(self, result, op: str, issued: _Issued | None, group, key, seq):
        if result is None:
            return None
        works = result if isinstance(result, list) else [result]
        countdown = None
        if issued is not None and (issued.device is not None or not self._on_completion(works, issued)):
            countdown = _Countdown(self, issued, len(works))
        wrapped = [_LoggedWork(self, w, op, group, key, seq, countdown) for w in works]
        return wrapped if isinstance(result, list) else wrapped[0]

    def _on_completion(self, works: list, issued: _Issued) -> bool:
        """Record ``issued`` from the works' own completion callback; False if the backend has none."""
        try:
            futures = [w.get_future() for w in works]
        except (RuntimeError, AttributeError, NotImplementedError):  # gloo's send/recv have none
            return False
        done = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)
        done.then(lambda _future: self._finish(issued))
        return True

    def _finish(self, issued: _Issued) -> None:
        if issued.device is None:
            self._record(issued, time.perf_counter() - issued.start)
            return
        issued.end_event = _record_event(issued.device)  # after the op on the stream: its GPU end
        self._pending.append(issued)
        if self.config.verbose:  # the line needs its time now
            self._read_events()
        elif len(self._pending) > PENDING_LIMIT:  # a long run without a summary: read what is done
            self._read_events(only_done=True)

    def _read_events(self, only_done: bool = False) -> None:
        """Record the CUDA-timed ops (in issue order), waiting for their end events; ``only_done``:
        stop at the first op still running on the GPU instead."""
        while self._pending:
            issued = self._pending[0]
            if only_done and not issued.end_event.query():
                return
            issued.end_event.synchronize()
            self._pending.popleft()
            self._record(issued, issued.start_event.elapsed_time(issued.end_event) / 1e3)

    def _off_node_peers(self, group) -> int | None:
        """This rank's peers in ``group`` on other nodes (the launcher's layout, `node_topology`); None
        where the environment names no layout that fits the world size (then no record says it)."""
        try:
            topology = node_topology(dist.get_world_size())
        except ValueError:
            return None
        key = (_group_key(group), topology.ranks_per_node)
        if key not in self._off_node:
            ranks = list(range(dist.get_world_size())) if key[0] == "world" else dist.get_process_group_ranks(group)
            self._off_node[key] = topology.off_node_peers(dist.get_rank(), ranks)
        return self._off_node[key]

    def _record(self, issued: _Issued, seconds: float) -> None:
        op, msg_bytes, world = issued.op, issued.msg_bytes, issued.world_size
        self._times[(op, msg_bytes, world, issued.off_node_peers)].append(seconds)
        if self.config.verbose:
            algbw = msg_bytes / seconds if seconds > 0 else 0.0
            line = (f"ds_comm | rank {issued.rank} | {op} | {_size(msg_bytes)} | {seconds * 1e3:.3f} ms | "
                    f"algbw {algbw / 1e9:.2f} GB/s | busbw {algbw * bus_factor(op, world) / 1e9:.2f} GB/s")
            log.info(line + (f" | {issued.caller}" if issued.caller else ""))

    # ---- hang diagnosis -------------------------------------------------------------------------------
    def _count(self, op: str, msg_bytes: int, key: str, caller: str) -> int:
        """Number this collective on its group, in memory (the publisher thread shares it)."""
        seq = self._sequences.get(key, 0) + 1
        self._sequences[key] = seq
        entry = {"seq": seq, "op": op, "bytes": msg_bytes, "caller": caller}
        self._positions[key] = entry  # a new dict each time: the publisher may be reading the old one
        self._history.append({**entry, "group": key})
        return seq

    def _publish(self, store, rank: int, last: str | None = None) -> str:
        text = json.dumps(dict(self._positions))  # dict(): a snapshot taken under the GIL
        if text != last:
            store.set(f"ds_comm/positions/{rank}", text)
        return text

    def _stop_publisher(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.stop()

    def _wait_or_diagnose(self, work, op: str, group, key: str, seq: int, timeout: float):
        try:
            completed = work.wait(timedelta(seconds=timeout))
        except RuntimeError as e:
            if not _timed_out(e):
                raise
            completed = False
        if completed is False:
            message = self._diagnose(op, group, key, seq, timeout)
            # one line now (the exception carries the diagnosis); the whole of it again at exit if
            # the exception was caught and never shown. On NCCL all of it now: the timed-out wait
            # has aborted the communicator, and NCCL's watchdog may take the process down before
            # the exception is shown or the exit hook runs.
            log.error("%s (raising CollectiveHang)", message if _on_nccl(group) else message.splitlines()[0])
            _distributed._mark_broken(message)
            raise CollectiveHang(message) from None
        return completed

    def _diagnose(self, op: str, group, key: str, seq: int, timeout: float) -> str:
        me = dist.get_rank()
        ranks = dist.get_process_group_ranks(group) if key != "world" else list(range(dist.get_world_size()))
        store = _store()
        self._publish(store, me)  # this rank's own position, exact
        positions, reported = {}, set()
        for rank in ranks:
            name = f"ds_comm/positions/{rank}"
            if store.check([name]):
                reported.add(rank)
                positions[rank] = json.loads(store.get(name)).get(key)
            else:
                positions[rank] = None
        behind = [r for r, p in positions.items() if p is None or p["seq"] < seq]
        ahead = [r for r, p in positions.items() if p is not None and p["seq"] > seq]

        def where(rank):
            p = positions[rank]
            if p is None:
                return f"rank {rank}: " + ("no collective on this group yet" if rank in reported
                                           else "no report (no collective since hang_timeout was set)")
            return f"rank {rank}: at {p['op']} #{p['seq']}" + (f" (from {p['caller']})" if p["caller"] else "")

        interval = min(PUBLISH_INTERVAL_S, timeout / 4)
        lines = [f"ds_comm: {op} #{seq} on group {key} did not complete within {timeout:g} s on rank {me}."]
        if behind:
            lines.append(f"rank(s) {behind} never reached {op} #{seq}: they skipped it or are stuck before it.")
        if ahead:
            lines.append(f"rank(s) {ahead} are past #{seq}: they ran a collective this rank did not.")
        if not behind and not ahead:
            lines.append("every rank reached this collective: the hang is inside it (network, deadlock in the backend).")
        lines.append(f"where each rank is (as last published, at most {interval:g} s old): "
                     + "; ".join(where(r) for r in ranks))
        lines.append("this rank's last ops: " + ", ".join(f"{h['op']} #{h['seq']} [{h['group']}]" for h in self._history))
        lines.append("the process group cannot be trusted after this: this rank leaves at exit with code "
                     f"{_distributed.HUNG_EXIT_CODE}; restart the job")
        return "\n".join(lines)

    # ---- summary --------------------------------------------------------------------------------------
    def records(self) -> list[OpRecord]:
        self._read_events()
        return [OpRecord(op, size, len(times), sum(times), world, off)
                for (op, size, world, off), times in sorted(self._times.items(), key=_record_order)]

    def log_summary(self, show_straggler: bool = False) -> list[dict]:
        """Log (rank 0; see the module's note on output) and return the per-op, per-size summary. With ``show_straggler`` every rank
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
            lines = [header + ("  straggler ms" if show_straggler else "")]
            for row in rows:
                line = (f"{row['op']:<24}{_size(row['msg_bytes']):>10}{row['count']:>8}{row['total_s'] * 1e3:>11.3f}"
                        f"{row['avg_s'] * 1e3:>9.3f}{row['algbw'] / 1e9:>12.3f}{row['busbw'] / 1e9:>12.3f}")
                lines.append(line + (f"{row['straggler_s'] * 1e3:>14.3f}" if show_straggler else ""))
            log.info("%s", "\n".join(lines))
        return rows


def _record_order(item) -> tuple:
    (op, size, world, off), _times = item
    return op, size, world, -1 if off is None else off


def _store():
    return dist.distributed_c10d._get_default_store()


def _on_nccl(group) -> bool:
    try:
        return "nccl" in str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return False


def _check_watchdog(hang_timeout: float) -> None:
    """On NCCL a collective running past the group's timeout is ended by NCCL's watchdog, which takes
    the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING): the diagnosis must come first."""
    limit = _distributed._group_timeout_now()
    if _on_nccl(None) and limit is not None and hang_timeout >= limit.total_seconds():
        log.warning("ds_comm: comms_logger.hang_timeout (%g s) is not below the process group's timeout (%g s): "
                    "NCCL's watchdog will end a hung collective before it can be diagnosed; pass a longer "
                    "timeout to init_distributed or a shorter hang_timeout", hang_timeout, limit.total_seconds())


def _cuda_device(tensors) -> torch.device | None:
    """The device of the op's first CUDA tensor, or None (the op is timed by host timers)."""
    return next((t.device for t in tensors if t.is_cuda), None)


def _record_event(device: torch.device):
    """A timing CUDA event recorded now on ``device``'s current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


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
