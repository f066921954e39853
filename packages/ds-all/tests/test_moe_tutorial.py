"""DeepSpeed's Mixture-of-Experts tutorial runs with its import changed: ``examples/moe_cifar_style.py``
(DeepSpeedExamples' CIFAR-10 script, ``import ds_all as deepspeed``) on 2 ranks under ds-launch with the
tutorial's flags and a ``--deepspeed_config`` file: expert parallelism 2 with top-1 RSample gating and
the MoE parameter groups at ZeRO stage 2, and PR-MoE (residual, a pyramid of 2 and 4 experts, top-2) at
ZeRO stage 1. Each run exits 0, prints the original's lines, and its loss falls."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "moe_cifar_style.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(stage: int) -> dict:
    """The example's ds_config.json in float32, with a short warm-up (its 1000 steps would leave the
    learning rate near 0 for the few steps run here)."""
    return {"train_batch_size": 16, "steps_per_print": 2000,
            "optimizer": {"type": "Adam", "params": {"lr": 0.003, "betas": [0.8, 0.999], "eps": 1e-8,
                                                      "weight_decay": 3e-7}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.003,
                                                          "warmup_num_steps": 5}},
            "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
            "zero_optimization": {"stage": stage, "allgather_partitions": True, "reduce_scatter": True,
                                  "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                                  "overlap_comm": True, "contiguous_gradients": True}}


@pytest.mark.parametrize("stage, flags", [
    (2, ["--ep-world-size", "2", "--num-experts", "2", "--top-k", "1", "--noisy-gate-policy", "RSample"]),
    (1, ["--ep-world-size", "2", "--num-experts", "2", "4", "--mlp-type", "residual", "--top-k", "2",
         "--min-capacity", "2"]),
], ids=["ep2-top1-rsample-zero2", "pr-moe-pyramid-top2-zero1"])
def test_the_moe_tutorial_example_trains_on_two_ranks(tmp_path, stage, flags):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(_config(stage)))
    # one log per rank: two ranks printing to one pipe interleave their writes
    result = subprocess.run(
        [sys.executable, "-m", "ds_launch", "--num_gpus", "2", "--master_port", str(_free_port()),
         "--enable_each_rank_log", str(tmp_path / "logs"), str(EXAMPLE), "--log-interval", "4", "--samples", "320",
         "--epochs", "2", "--deepspeed", "--deepspeed_config", str(config), "--moe", "--moe-param-group", *flags],
        capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    out, other = ((tmp_path / "logs" / f"rank{r}.log").read_text() for r in range(2))
    # 320 images, 16 a step: 20 steps an epoch, rank 0's running loss every 4
    losses = [(int(m[1]), int(m[2]), float(m[3])) for m in re.finditer(r"^\[(\d), +(\d+)\] loss: ([0-9.]+)$", out, re.M)]
    assert [(e, i) for e, i, _ in losses] == [(e, i) for e in (1, 2) for i in (4, 8, 12, 16, 20)], out
    assert losses[-1][2] < 0.6 * losses[0][2], losses
    assert [log.splitlines().count("Finished Training") for log in (out, other)] == [1, 1], (out, other)
    accuracy = re.search(r"^Accuracy of the network on the 40 test images: (\d+) %$", out, re.M)
    assert accuracy and int(accuracy[1]) > 30, out  # chance is 10 %
