"""Start child processes and watch them until all succeed, one fails, or we are told to stop.

Each child leads its own process group (session), so stopping it also stops what it started
(data-loader workers, a shell's children). When a child fails, the others get SIGTERM, then
SIGKILL after the grace period; when the supervisor gets SIGINT/SIGTERM/SIGHUP it passes the
signal on, with the same escalation. On Linux each child also gets PR_SET_PDEATHSIG, so even a
SIGKILLed supervisor leaves no rank behind.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.02
_REMOTE_EXTRA_SECONDS = 5.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _child_setup(cpus: tuple[int, ...]):
    """The function run in the child between fork and exec."""
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl

    def setup() -> None:
        if prctl is not None:
            prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the supervisor
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


@dataclass
class Child:
    label: str
    process: subprocess.Popen
    log_path: str | None = None

    @property
    def where_output(self) -> str:
        if self.log_path:
            return f"its log: {self.log_path}"
        return "its output is above (--enable_each_rank_log DIR writes one log per rank)"


def spawn(label: str, argv: list[str], env: dict[str, str], *, cpus: tuple[int, ...] = (),
          log_path: str | None = None, stdin=None) -> Child:
    out = open(log_path, "wb") if log_path else None  # noqa: SIM115 - handed to the child
    try:
        process = subprocess.Popen(
            argv, env=env, stdin=stdin, stdout=out, stderr=subprocess.STDOUT if out else None,
            start_new_session=True, preexec_fn=_child_setup(cpus),
        )
    except OSError as e:
        raise OSError(e.errno, f"cannot start {label}: {argv[0]}: {e.strerror}") from None
    finally:
        if out:
            out.close()
    return Child(label, process, log_path)


def exit_code(returncode: int) -> int:
    """A shell-style exit code: a child killed by signal N reports 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class Supervisor:
    """Wait for children; on the first failure or a stop signal, stop every one of them.

    Use as a context manager: the signal handlers are in place before the first child starts,
    and leaving the block stops whatever is still running.
    """

    def __init__(self, kill_grace: float, name: str = "ds-launch"):
        self.children: list[Child] = []
        self.kill_grace = kill_grace
        self.name = name
        self._signal: int | None = None
        self._previous: dict = {}

    def _on_signal(self, signum, frame) -> None:
        self._signal = self._signal or signum

    def __enter__(self) -> Supervisor:
        self._previous = {s: signal.signal(s, self._on_signal) for s in _STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop(signal.SIGTERM)  # also reaps what finished children left in their groups
        finally:
            for s, handler in self._previous.items():
                signal.signal(s, handler)

    def add(self, child: Child) -> None:
        self.children.append(child)

    def watch(self) -> int:
        """Block until every child succeeded (0), one failed (its code) or a signal came (128+N)."""
        return self._watch()

    def _watch(self) -> int:
        running = list(self.children)
        while running:
            if self._signal is not None:
                name = signal.Signals(self._signal).name
                self._report(f"got {name}; stopping {len(running)} process(es)")
                self.stop(self._signal)
                return 128 + self._signal
            for child in list(running):
                code = child.process.poll()
                if code is None:
                    continue
                running.remove(child)
                if code != 0:
                    self._report(f"{child.label} exited with code {exit_code(code)}; {child.where_output}")
                    if running:
                        self._report(f"stopping the other {len(running)} process(es)")
                    self.stop(signal.SIGTERM)
                    return exit_code(code)
            if running:
                time.sleep(_POLL_SECONDS)
        return 0

    def _report(self, message: str) -> None:
        print(f"{self.name}: {message}", file=sys.stderr, flush=True)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop every child and what it started, then SIGKILL what is still alive after the grace.

        A child with a stdin pipe is an ssh client whose remote node agent takes EOF as "stop":
        it gets EOF instead of a signal, and more time, since the agent first waits out its own
        grace for its ranks. Its exit then means the remote ranks are gone too.
        """
        start = time.monotonic()
        for child in self.children:
            if child.process.stdin:
                child.process.stdin.close()
            else:
                _signal_group(child.process.pid, signum)
        for child in self.children:
            grace = self.kill_grace * 2 + _REMOTE_EXTRA_SECONDS if child.process.stdin else self.kill_grace
            try:
                child.process.wait(timeout=max(0.0, start + grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for child in self.children:
            _signal_group(child.process.pid, signal.SIGKILL)
            child.process.wait()


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
