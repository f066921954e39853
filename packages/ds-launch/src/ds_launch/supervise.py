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
    """Wait for children; on the first failure or a stop signal, stop every one of them."""

    def __init__(self, children: list[Child], kill_grace: float, name: str = "ds-launch"):
        self.children = children
        self.kill_grace = kill_grace
        self.name = name
        self._signal: int | None = None

    def _on_signal(self, signum, frame) -> None:
        self._signal = self._signal or signum

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in _STOP_SIGNALS}
        try:
            return self._watch()
        finally:
            self.stop(signal.SIGTERM)  # reaps leftovers of finished groups too
            for s, handler in previous.items():
                signal.signal(s, handler)

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
        """Signal every child's process group, then SIGKILL what is still alive after the grace."""
        for child in self.children:
            if child.process.stdin:
                child.process.stdin.close()  # a remote node agent takes EOF as "stop"
            _signal_group(child.process.pid, signum)
        deadline = time.monotonic() + self.kill_grace
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
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
