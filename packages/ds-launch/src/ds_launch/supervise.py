"""Start child processes and watch them until all succeed, one fails, or we are told to stop.

Each child leads its own process group (session), so stopping it also stops what it started
(data-loader workers, a shell's children). When a child fails, the others get SIGTERM, then
SIGKILL after the grace period; when the supervisor gets SIGINT/SIGTERM/SIGHUP it passes the
signal on, with the same escalation. When a child exits, what is left of its group is killed
before the child is reaped (so the group id cannot have been reused by then). On Linux each
child also gets PR_SET_PDEATHSIG=SIGKILL: a SIGKILLed supervisor takes its children with it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from .resources import LaunchError

_POLL_SECONDS = 0.02
_REMOTE_EXTRA_SECONDS = 5.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _child_setup(cpus: tuple[int, ...]):
    """The function run in the child between fork and exec."""
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def setup() -> None:
        if prctl is not None:
            prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the supervisor died before prctl took effect
                os._exit(1)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


@dataclass
class Child:
    label: str
    process: subprocess.Popen
    log_path: str | None = None
    stop_with_eof: bool = False  # an ssh client: closing its stdin stops the remote node agent
    failure: int | None = None  # set by an output watcher when a remote part has already failed

    @property
    def where_output(self) -> str:
        if self.log_path:
            return f"its log: {self.log_path}"
        return "its output is above (--enable_each_rank_log DIR writes one log per rank)"

    def exited(self) -> bool:
        """True once the child has exited, without reaping it (its pid and group stay reserved)."""
        if self.process.returncode is not None:
            return True
        return os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def reap(self) -> int:
        """Kill what is left of the exited child's group, then collect its exit status."""
        _signal_group(self.process.pid, signal.SIGKILL)
        return self.process.wait()


def spawn(label: str, argv: list[str], env: dict[str, str], *, cpus: tuple[int, ...] = (),
          log_path: str | None = None, stdin=None, stop_with_eof: bool = False,
          failure_line: str | None = None) -> Child:
    """Start ``argv`` in a new session. ``failure_line``: a regex whose ``code`` group, matched on a
    line of the child's stderr, marks the child failed at once (pdsh reports a failed node that
    way but waits for every other node before it exits); the lines still reach our stderr."""
    try:
        out = open(log_path, "wb") if log_path else None  # noqa: SIM115 - handed to the child
    except OSError as e:
        raise LaunchError(f"cannot write the log of {label} to {log_path}: {e.strerror}") from None
    try:
        process = subprocess.Popen(
            argv, env=env, stdin=stdin, stdout=out,
            stderr=subprocess.STDOUT if out else subprocess.PIPE if failure_line else None,
            start_new_session=True, preexec_fn=_child_setup(cpus),
        )
    except OSError as e:
        raise LaunchError(f"cannot start {label}: {argv[0]}: {e.strerror}") from None
    finally:
        if out:
            out.close()
    child = Child(label, process, log_path, stop_with_eof)
    if failure_line:
        threading.Thread(target=_watch_output, args=(child, re.compile(failure_line.encode())), daemon=True).start()
    return child


def _watch_output(child: Child, failure: re.Pattern) -> None:
    for line in child.process.stderr:
        sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()
        m = failure.search(line)
        if m and child.failure is None:
            child.failure = int(m["code"]) or 1


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
            self.stop(signal.SIGTERM)  # a no-op when every child is already reaped
        finally:
            for s, handler in self._previous.items():
                signal.signal(s, handler)

    @property
    def signal_received(self) -> int | None:
        """The first stop signal that came while the block ran, or None."""
        return self._signal

    def add(self, child: Child) -> None:
        self.children.append(child)

    def watch(self) -> int:
        """Block until every child succeeded (0), one failed (its code) or a signal came (128+N)."""
        running = list(self.children)
        while running:
            if self._signal is not None:
                self._report(f"got {signal.Signals(self._signal).name}; stopping {len(running)} process(es)")
                self.stop(self._signal)
                return 128 + self._signal
            for child in list(running):
                if child.failure is not None:
                    code, what = child.failure, "reports a failed node:"
                elif child.exited():
                    code, what = child.reap(), "exited with"
                else:
                    continue
                running.remove(child)
                if code != 0:
                    self._report(f"{child.label} {what} code {exit_code(code)}; {child.where_output}")
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
        """Stop every live child and its group; SIGKILL what is still alive after the grace.

        An ssh client (``stop_with_eof``) gets EOF instead of a signal, and more time, since its
        remote node agent first waits out its own grace for its ranks; its exit then means the
        remote ranks are gone too.
        """
        live = [c for c in self.children if c.process.returncode is None]
        start = time.monotonic()
        for child in live:
            if child.process.stdin:
                child.process.stdin.close()
            if not child.stop_with_eof:
                _signal_group(child.process.pid, signum)
        while live:
            for child in list(live):
                grace = self.kill_grace * 2 + _REMOTE_EXTRA_SECONDS if child.stop_with_eof else self.kill_grace
                if child.exited():
                    child.reap()
                    live.remove(child)
                elif time.monotonic() - start >= grace:
                    _signal_group(child.process.pid, signal.SIGKILL)
                    child.process.wait()
                    live.remove(child)
            if live:
                time.sleep(_POLL_SECONDS)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
