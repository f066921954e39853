"""The main job runs under ds-launch on 2 ranks through ds-comm, its loss goes down and the comms
logger's summary counts its collectives."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_data_parallel.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_demo_trains_on_two_ranks_and_the_loss_goes_down():
    result = subprocess.run([sys.executable, "-m", "ds_launch", "--num_procs", "2", "--master_port", str(_free_port()), str(EXAMPLE),
                             "--steps", "15"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([0-9.]+)$", result.stdout, re.M)]
    assert len(losses) == 15
    assert losses[-1] < 0.5 * losses[0]
    assert "parameters identical on every rank: True" in result.stdout
    assert re.search(r"^loss went down: ", result.stdout, re.M)
    # the comms logger saw every collective: one coalesced gradient all-reduce and one loss
    # all-reduce per step, one all-gather of the checksums
    counts = {m[1]: int(m[2]) for m in re.finditer(r"^(\w+) +\d+ B +(\d+) ", result.stdout, re.M)}
    assert counts == {"all_reduce_coalesced": 15, "all_reduce": 15, "all_gather_into_tensor": 1}, result.stdout
