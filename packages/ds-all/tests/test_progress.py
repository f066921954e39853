"""The engine's progress bar: drawn on rank 0 when stderr is a terminal, with the schedule's total and
the loss; nothing on the other ranks or when stderr is a file or pipe; the periodic log line is
written with the bar cleared around it."""

from __future__ import annotations

import io
import sys

import torch
from torch import nn

import ds_all
from ds_all._progress import ProgressBar
from ds_comm.testing import spawn


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_draws_only_on_a_terminal():
    terminal, pipe = _Terminal(), io.StringIO()
    drawn, hidden = ProgressBar(enabled=True, total=4, stream=terminal), ProgressBar(enabled=True, total=4, stream=pipe)
    off = ProgressBar(enabled=False, total=4, stream=_Terminal())
    for step in (1, 2, 3, 4):
        for bar in (drawn, hidden, off):
            bar.update(step, 0.5 / step, [1e-3])
    for bar in (drawn, hidden, off):
        bar.close()
    assert "4/4" in terminal.getvalue() and "loss=0.1250" in terminal.getvalue()
    assert "lr=0.001" in terminal.getvalue()
    assert pipe.getvalue() == "" and drawn.bar is None and off.bar is None


def engine_bar(rank, world_size, terminal):
    sys.stderr = _Terminal() if terminal else io.StringIO()
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 3,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2}}}
    engine, *_ = ds_all.initialize(model=nn.Linear(4, 1), config=config)
    for _ in range(6):
        loss = engine(torch.randn(2, 4)).square().mean()
        engine.backward(loss)
        engine.step()
    engine.destroy()
    return sys.stderr.getvalue()


def test_the_engine_shows_steps_of_the_schedules_total_on_rank_0():
    on_terminal = spawn(engine_bar, world_size=2, args=(True,))
    assert "6/6" in on_terminal[0] and "loss=" in on_terminal[0]
    assert on_terminal[1] == ""  # rank 1 draws nothing
    assert spawn(engine_bar, world_size=2, args=(False,)) == ["", ""]
