"""The engine's progress bar: optimizer steps on rank 0, drawn by ``tqdm`` on stderr when stderr is a
terminal (never into a log file or a pipe). Its total is the schedule's ``total_num_steps`` when the
schedule has one (WarmupDecayLR, WarmupCosineLR), else it counts up with the rate. ``TQDM_DISABLE=1``
turns it off (tqdm's own switch); without ``tqdm`` installed there is none."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, TextIO


class ProgressBar:
    def __init__(self, *, enabled: bool, total: int | None = None, stream: TextIO | None = None):
        self.bar: Any = None
        stream = sys.stderr if stream is None else stream
        if not enabled or not _is_terminal(stream):
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, unit="step", file=stream, dynamic_ncols=True, desc="ds_all")

    def update(self, step: int, loss: float | None, lrs: list[float]) -> None:
        if self.bar is None:
            return
        self.bar.update(step - self.bar.n)
        postfix = {"lr": ", ".join(f"{lr:.3g}" for lr in lrs)}
        if loss is not None:
            postfix["loss"] = f"{loss:.4f}"
        self.bar.set_postfix(postfix, refresh=False)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Around a log line to the terminal: the bar is cleared, then drawn again below it."""
        if self.bar is None:
            yield
            return
        self.bar.clear()
        try:
            yield
        finally:
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a file
        return False
