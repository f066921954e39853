"""A failure of one rank while `initialize` builds the engine is an error on that rank, never a hang.

Rank 0 alone makes the monitors. When that failed after ZeRO stage 3 had partitioned the model, the engine's
cleanup (`ZeroOptimizer.close`, which gathers every parameter: a collective) waited while the other rank went
on to train, and the job hung instead of failing: the demo, where TensorBoard is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ds_comm.testing import free_port

DEMO = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def test_the_demo_without_tensorboard_fails_on_rank_0_and_hangs_no_one(tmp_path):
    stub = tmp_path / "stub" / "tensorboard"  # shadows an installed TensorBoard: importing it fails
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('no tensorboard here (the test)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(stub.parent), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ds_launch", "--num_procs", "2", "--master_port", str(free_port()),
                           str(DEMO), "--tiny", "--steps", "4"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "tensorboard.enabled is true but the tensorboard package is not installed" in output, output[-3000:]
    assert time.monotonic() - start < 120, output[-3000:]  # which rank ds-launch sees leave first varies
