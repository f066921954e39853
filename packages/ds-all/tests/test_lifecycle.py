"""The engine's lifecycle: ``destroy()`` gives back what ``initialize`` took (5 initialize/destroy
cycles in one process end within 5 % of the RSS after the first), and a 2-rank script that builds its
optimizer after the gloo group exists exits cleanly every time (0 aborts over DS_ALL_EXIT_RUNS runs)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import torch
from torch import nn

import ds_all
import ds_comm
from ds_comm.testing import spawn

CYCLES = 5
# CI runs 5 (each run is two fresh interpreters importing torch: ~5 s here); the figure, 0
# aborts over 40 runs, is DS_ALL_EXIT_RUNS=40 (ds-comm's own exit test runs 40 in its standalone session)
RUNS = int(os.environ.get("DS_ALL_EXIT_RUNS", "5"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cycles_of_initialize_and_destroy(rank, world_size):
    ds_comm.destroy_process_group()  # initialize creates (and destroy frees) its own group each cycle
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    rss, groups = [], []
    for _cycle in range(CYCLES):  # every group on the harness's MASTER_PORT, as a user's loop has it
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))  # ~2 MiB of weights
        engine, *_ = ds_all.initialize(model=model, config=config)
        for _ in range(2):
            engine.backward(engine(torch.randn(4, 256)).square().mean())
            engine.step()
        engine.destroy()
        groups.append(ds_comm.is_initialized())
        del engine, model
        rss.append(_rss_bytes())
    return rss, groups


def test_destroy_gives_back_the_memory_and_the_process_group():
    for rss, groups in spawn(cycles_of_initialize_and_destroy, world_size=2, timeout=240):
        assert groups == [False] * CYCLES  # each destroy() freed the group its initialize made
        assert rss[-1] <= rss[0] * 1.05, [f"{r / 2**20:.1f} MiB" for r in rss]


SCRIPT = textwrap.dedent("""
    import os, torch, ds_all
    from torch import nn
    model = nn.Linear(4, 1)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
    # the optimizer is built after the gloo group exists (the hazard: torch._dynamo, imported by the
    # first torch optimizer, keeping the group alive so gloo's threads abort the process at exit)
    engine, *_ = ds_all.initialize(model=model, optimizer=lambda params: torch.optim.AdamW(params, lr=0.1),
                                   config=config)
    loss = engine(torch.randn(2, 4)).square().mean()
    engine.backward(loss)
    engine.step()
    os.write(1, f"done {engine.global_steps}\\n".encode())  # one write: print() under -u splits lines
""")


def test_no_rank_aborts_at_exit_over_many_runs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    failures = []
    for run in range(RUNS):
        result = subprocess.run([sys.executable, "-m", "ds_launch", "--num_procs", "2", "--master_port",
                                 str(_free_port()), str(script)], capture_output=True, text=True, timeout=120)
        if result.returncode != 0 or result.stdout.splitlines().count("done 1") != 2:
            failures.append((run, result.returncode, result.stderr[-2000:]))
    assert failures == [], f"{len(failures)} of {RUNS} runs failed; first: {failures[0]}"
