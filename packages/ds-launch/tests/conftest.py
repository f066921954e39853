"""Shared helpers for ds-launch's tests: real processes, no mocks of the process layer."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

# A rank program that records what it was given: argv, the launcher's variables, its affinity.
DUMP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "CROSS_RANK", "CROSS_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
             "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"]
    extra = [n for n in os.environ if n.startswith(("HOSTILE", "NCCL_", "UCX_", "MV2_", "FROM_ENV_FILE"))]
    record = {"argv": sys.argv[1:], "env": {n: os.environ.get(n) for n in names + extra},
              "cpus": sorted(os.sched_getaffinity(0)), "ppid": os.getppid(), "cwd": os.getcwd()}
    out = os.environ["DUMP_DIR"]
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(record, f)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args: str, timeout: float = 120, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run ``ds-launch`` (as ``python -m ds_launch``) to completion."""
    return subprocess.run([sys.executable, "-m", "ds_launch", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd)


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose command line contains ``marker`` (zombies excluded)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "cmdline").read_bytes():
                status = (entry / "status").read_text()
                if "\nState:\tZ" not in status:
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.fixture
def dump(tmp_path):
    """(script path, output dir, reader) for the recording rank program."""
    script = tmp_path / "dump_rank.py"
    script.write_text(DUMP_SCRIPT)
    out = tmp_path / "dumps"
    out.mkdir()

    def read(rank: int) -> dict:
        return json.loads((out / f"rank{rank}.json").read_text())

    return script, out, read


@pytest.fixture
def marker():
    """A unique token put on the command line of every process a test starts."""
    token = f"ds-launch-test-{uuid.uuid4().hex}"
    yield token
    leftovers = processes_with(token)
    for pid in leftovers:  # never leave a mess for the next test, but fail this one
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    assert not leftovers, f"processes survived the test: {leftovers}"


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    """The launches here are CPU/gloo launches, also on a machine with GPUs (where the default
    would be one rank per GPU). The GPU logic has its own tests without processes."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def new_port():
    """A function returning a free port, for tests that need more than one."""
    return free_port


@pytest.fixture
def run_launcher():
    return launch


@pytest.fixture
def alive():
    return processes_with
