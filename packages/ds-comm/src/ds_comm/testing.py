"""Run a function on N spawned ranks with gloo: the harness every distributed test of ds uses.

    from ds_comm.testing import spawn

    def check_sum(rank, world_size):          # a module-level function of the test file
        t = torch.ones(1) * rank
        ds_comm.all_reduce(t)
        return t.item()

    def test_sum():
        assert spawn(check_sum, world_size=2) == [1.0, 1.0]

Ranks are forked from a server process that has imported torch and nothing else (multiprocessing's
``forkserver``: forking a process that has run torch's OpenMP code can hang the child, and a fresh
interpreter pays torch's import again, seconds a rank), each with the caller's environment as it is
at the call and ``init_distributed`` done on a free port. A rank that raises makes
``spawn`` raise `RankFailed` with that rank's traceback, and so does a rank that reports but then
exits with a non-zero code (an abort at exit) or does not exit within `EXIT_TIMEOUT_S`; ranks
still running after ``timeout`` seconds are killed and `RankTimeout` names them, so a test never
hangs. The function travels by
reference (module file + name), so it must be a module-level function; test modules that pytest
imports without a package (``--import-mode=importlib``) work too.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

EXIT_TIMEOUT_S = 30.0  # how long ranks that reported may take to exit
# What the fork server imports once, so that no rank imports it again: torch (and its distributed
# package) is most of a rank's start-up; it runs no parallel region there, so forking it is safe.
# torch.distributed.checkpoint too (about 4 s with DTensor and sympy): ds-zero imports it only when a
# checkpoint is saved or loaded, which the ranks of many tests do, each paying it again without this.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint"]


class RankFailed(RuntimeError):
    """A rank raised (the message holds its rank and traceback), or exited with a non-zero code."""


class RankTimeout(RuntimeError):
    """Ranks did not finish in time and were killed."""


def free_port() -> int:
    """A TCP port free on this machine now (the OS picks it, so parallel tests do not collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class _FunctionRef:
    module: str
    file: str | None
    qualname: str

    @classmethod
    def of(cls, fn: Callable) -> _FunctionRef:
        qualname = getattr(fn, "__qualname__", "")
        if not qualname or "<" in qualname or "." in qualname:
            raise ValueError(f"spawn needs a module-level function, got {qualname or fn!r}: "
                             "define it at the top level of the test module")
        module = sys.modules.get(fn.__module__)
        return cls(fn.__module__, getattr(module, "__file__", None), qualname)

    def load(self) -> Callable:
        try:
            module = importlib.import_module(self.module)
        except ImportError:
            if self.file is None:
                raise
            spec = importlib.util.spec_from_file_location(self.module, self.file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[self.module] = module
            spec.loader.exec_module(module)
        return getattr(module, self.qualname)


def _context():
    context = mp.get_context("forkserver")
    # and the ds packages the caller has imported (ds-zero's import alone took ~2 s: torch's distributed
    # checkpoint, the ops): imported once by the fork server (when the first spawn starts it), not per rank
    ours = sorted(name for name in sys.modules if name.startswith("ds_") and "." not in name)
    context.set_forkserver_preload([*_PRELOAD, *ours])
    return context


def _received_fds(*fds) -> tuple[int, ...]:
    return tuple(fd.detach() for fd in fds)


class _CallerStdio:
    """The caller's stdout and stderr as they are at the call (pytest's capfd swaps them per test):
    sent to the rank with the process, whose own are the fork server's."""

    def __reduce__(self):
        from multiprocessing import reduction

        return _received_fds, (reduction.DupFd(1), reduction.DupFd(2))


def _shut_down_as_an_interpreter_does() -> None:
    """A forked rank leaves by ``os._exit`` and skips what an interpreter's exit runs: waiting for
    non-daemon threads and the ``atexit`` functions (an abort there must still fail the run)."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()


def _rank_main(rank: int, world_size: int, port: int, ref: _FunctionRef, args: tuple, kwargs: dict,
               results, backend: str, environ: dict[str, str], env: dict[str, str], stdio: tuple[int, int],
               teardown: bool, ranks_per_node: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(stdio[0], 1)
    os.dup2(stdio[1], 2)
    os.environ.clear()  # the caller's environment as it is now (the fork server kept the one it started with)
    os.environ.update(environ)
    # as ds-launch sets them for ranks_per_node ranks on each of world_size / ranks_per_node nodes
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % ranks_per_node),
                       "LOCAL_WORLD_SIZE": str(ranks_per_node), "LOCAL_SIZE": str(ranks_per_node),
                       "CROSS_RANK": str(rank // ranks_per_node), "CROSS_SIZE": str(world_size // ranks_per_node),
                       **env})
    # one intra-op thread a rank unless the caller says otherwise, as torchrun does: ranks with a thread
    # per core each oversubscribe the cores 2-3x slower here (2 ranks x 2 threads on 2 cores)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks a hung rank for its stacks
    import ds_comm

    try:
        ds_comm.init_distributed(dist_backend=backend)
        # by value: torch's queue would share a tensor's storage through this process, gone by the time
        # the caller reads it
        value = pickle.dumps(ref.load()(rank, world_size, *args, **kwargs))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    if teardown:
        ds_comm.destroy_process_group()
        results.put((rank, True, value))
        results.close()
        results.join_thread()  # the report is sent before anything at exit can go wrong
        _shut_down_as_an_interpreter_does()
        return
    # no teardown (the test left the group unusable on purpose): report, then leave at once
    results.put((rank, True, value))
    results.close()
    results.join_thread()
    os._exit(0)


def spawn(fn: Callable, world_size: int = 2, args: tuple = (), kwargs: dict | None = None, *,
          timeout: float = 120.0, backend: str = "gloo", env: dict[str, str] | None = None,
          teardown: bool = True, ranks_per_node: int | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return their results
    in rank order. Raises `RankFailed` (first failing rank, with traceback) or `RankTimeout`.
    ``teardown=False`` skips the closing barrier and destroy (for tests that break the group).
    ``ranks_per_node``: the ranks play ``world_size / ranks_per_node`` nodes, each rank with the
    launcher's variables of its node (LOCAL_RANK, LOCAL_WORLD_SIZE/LOCAL_SIZE, CROSS_RANK/CROSS_SIZE);
    default: one node of every rank."""
    if world_size < 1:
        raise ValueError(f"spawn: world_size must be >= 1, got {world_size}")
    ranks_per_node = world_size if ranks_per_node is None else ranks_per_node
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"spawn: ranks_per_node must be a whole number >= 1 dividing world_size {world_size}, "
                         f"got {ranks_per_node!r}")
    ref = _FunctionRef.of(fn)
    context = _context()
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank_main, args=(r, world_size, port, ref, tuple(args), dict(kwargs or {}),
                                                     results, backend, dict(os.environ), dict(env or {}),
                                                     _CallerStdio(), teardown, ranks_per_node), daemon=True)
             for r in range(world_size)]
    for process in ranks:
        process.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.05)
            except queue.Empty:
                _check_dead(ranks, values)
                if time.monotonic() > deadline:
                    pending = sorted(set(range(world_size)) - set(values))
                    for r in pending:
                        if ranks[r].is_alive():
                            os.kill(ranks[r].pid, signal.SIGUSR1)  # their stacks go to stderr
                    time.sleep(0.2)  # let faulthandler write them before the kill
                    raise RankTimeout(f"ranks {pending} of {world_size} did not finish within {timeout:g} s "
                                      "and were killed (their Python stacks are printed above)") from None
                continue
            if not ok:
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{payload}")
            values[rank] = pickle.loads(payload)
        _check_exits(ranks)
    finally:
        for process in ranks:
            if process.exitcode is None:
                process.join(timeout=0.5)
            if process.is_alive():
                process.kill()
                process.join()
    return [values[r] for r in range(world_size)]


def _check_exits(ranks) -> None:
    """Every rank reported: each must also exit, with code 0."""
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    for process in ranks:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    bad = []
    for rank, process in enumerate(ranks):
        code = process.exitcode
        if code is None:
            bad.append(f"rank {rank} was still running {EXIT_TIMEOUT_S:g} s after reporting (killed)")
        elif code < 0:
            bad.append(f"rank {rank} was killed by {signal.Signals(-code).name} (exit code {code})")
        elif code > 0:
            bad.append(f"rank {rank} exited with code {code}")
    if bad:
        raise RankFailed(f"every rank of {len(ranks)} reported, but " + "; ".join(bad)
                         + " (an abort or exit error after the function returned)")


def _check_dead(ranks, values: dict) -> None:
    """A rank that died without reporting (killed, segfault) fails the run at once."""
    for rank, process in enumerate(ranks):
        if rank not in values and not process.is_alive() and process.exitcode not in (None, 0):
            raise RankFailed(f"rank {rank} died with exit code {process.exitcode} before reporting")
