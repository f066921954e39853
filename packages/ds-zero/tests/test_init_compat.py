"""`ds_zero.Init` as DeepSpeed's: it starts the process group itself when none exists (from the launcher's
environment), and a model built under a 16-bit dtype draws its initial weights in that dtype, so they are
the values DeepSpeed's Init gives (not float32 draws rounded)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import torch
from torch import nn

import ds_comm
import ds_zero
from ds_comm.testing import spawn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_init_starts_the_process_group_from_the_environment_as_deepspeeds_does():
    script = textwrap.dedent("""
        import torch, ds_comm, ds_zero
        assert not ds_comm.is_initialized()
        with ds_zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
            layer = torch.nn.Linear(4, 4)
        print("INITIALIZED", ds_comm.is_initialized(), ds_comm.get_world_size(), tuple(layer.weight.ds_shape))
    """)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "INITIALIZED True 1 (4, 4)" in result.stdout


def built_in_16_bits(rank, world_size, dtype):
    torch.manual_seed(0)
    with ds_zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}, "bf16": {"enabled": dtype == "bf16"},
                                           "fp16": {"enabled": dtype == "fp16"}}):
        layer = nn.Linear(64, 64)
        inside = torch.get_default_dtype()
    after = torch.get_default_dtype()
    with ds_zero.GatheredParameters(list(layer.parameters())):
        weight = layer.weight.detach().clone()
    ds_comm.barrier()
    return weight, inside, after


def test_a_model_built_under_a_16_bit_init_draws_its_weights_in_that_dtype():
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        previous = torch.get_default_dtype()
        torch.manual_seed(0)
        torch.set_default_dtype(torch_dtype)
        try:
            want = nn.Linear(64, 64).weight.detach()  # drawn in 16 bits, as under DeepSpeed's Init
        finally:
            torch.set_default_dtype(previous)
        torch.manual_seed(0)
        rounded = nn.Linear(64, 64).weight.detach().to(torch_dtype)  # float32 draws rounded: not DeepSpeed's
        assert dtype == "fp16" or not torch.equal(want, rounded)  # bf16's uniform_ rounds differently
        for weight, inside, after in spawn(built_in_16_bits, world_size=2, args=(dtype,)):
            assert weight.dtype == torch_dtype and torch.equal(weight, want)
            assert inside == torch_dtype and after == torch.float32  # the default dtype is restored at exit
