"""ZeRO++ through the engine: the config of DeepSpeed's ZeRO++ tutorial (``zero_quantized_weights``,
``zero_hpz_partition_size`` 16, ``zero_quantized_gradients`` at stage 3) trains an unmodified DeepSpeed script
under ``ds-launch --deepspeed_alias`` with ZeRO++'s collectives on the wire; DeepSpeed's refusal of
torch autocast with quantized weights is kept."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

from ds_all.config import Config

# DeepSpeed's ZeRO++ tutorial's zero_optimization section, as it is (hpz 16: min(16, world size) ranks, as there)
TUTORIAL_ZERO = {"stage": 3, "reduce_bucket_size": 10000000, "reduce_scatter": True, "zero_quantized_weights": True,
                 "zero_hpz_partition_size": 16, "zero_quantized_gradients": True, "contiguous_gradients": True,
                 "overlap_comm": True}

SCRIPT = textwrap.dedent("""
    import argparse, json
    import torch
    from torch import nn
    import deepspeed
    import deepspeed.comm as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for step in range(12):
        x = torch.randn(8, 256, generator=g)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    ops = sorted({row["op"] for row in dist.log_summary()})
    if dist.get_rank() == 0:
        print("RESULT", json.dumps({"losses": losses, "ops": ops}), flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, zero: dict) -> dict:
    (tmp_path / "train.py").write_text(SCRIPT)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": zero,
              "comms_logger": {"enabled": True, "prof_all": True}}
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    result = subprocess.run([sys.executable, "-m", "ds_launch", "--deepspeed_alias", "--num_procs", "2",
                             "--master_port", str(_free_port()), "train.py", "--deepspeed",
                             "--deepspeed_config", "ds_config.json"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(re.search(r"RESULT (.*)", result.stdout).group(1))


def test_the_tutorials_zeropp_config_trains_an_unmodified_deepspeed_script(tmp_path):
    found = _launch(tmp_path, TUTORIAL_ZERO)
    plain = _launch(tmp_path, {**TUTORIAL_ZERO, "zero_quantized_weights": False, "zero_hpz_partition_size": 1,
                               "zero_quantized_gradients": False})["losses"]
    losses, ops = found["losses"], found["ops"]
    assert losses[-1] < 0.8 * losses[0], losses
    assert losses != plain and all(abs(a / b - 1) < 0.02 for a, b in zip(losses, plain, strict=True)), (losses, plain)
    # qwZ's gathers (forward), hpZ's inside the secondary group (backward), qgZ's reduction
    assert {"quantized_all_gather", "all_gather_bucket", "quantized_reduce_scatter"} <= set(ops), ops
    assert "reduce_scatter_bucket" not in ops, ops


def test_torch_autocast_with_quantized_weights_is_refused_as_in_deepspeed():
    with pytest.raises(ValueError, match=re.escape(
            "torch_autocast.enabled and zero_optimization.zero_quantized_weights are both true: DeepSpeed cannot "
            "enable both torch autocast and zero quantized weights")):
        Config.load({"torch_autocast": {"enabled": True}, "zero_optimization": TUTORIAL_ZERO})
    Config.load({"torch_autocast": {"enabled": True}, "zero_optimization": {"stage": 3}})
