"""DeepSpeed's ``deepspeed.utils.safe_get_full_grad`` & co through the engine on 2 ranks (``ds_all.utils``):
at the accumulation boundary the full gradient is DDP's (averaged over the ranks and the micro-steps), after
the step the master weights and Adam's moments are ``torch.optim.AdamW``'s, a weight set to zeros makes the
next forward output the bias; ``engine.empty_partition_cache()`` at stage 3 releases every gathered parameter
and the pooled gather buffers, and training goes on with the same results."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ds_all
import ds_comm
import ds_zero
from ds_all.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
)
from ds_comm.testing import spawn

GAS, MICRO = 2, 4
ADAMW = {"lr": 1e-2, "weight_decay": 0.01}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(MICRO, 8, generator=g), torch.randn(MICRO, 1, generator=g)


def _reference_step(reference, optimizer, step, world_size) -> list[torch.Tensor]:
    optimizer.zero_grad()
    for rank in range(world_size):
        for micro in range(GAS):
            x, y = _batch(step, micro, rank)
            (F.mse_loss(reference(x), y) / GAS / world_size).backward()
    grads = [p.grad.clone() for p in reference.parameters()]
    optimizer.step()
    return grads


def train(rank, world_size, stage, bf16):
    reference = _model()
    model = copy.deepcopy(reference)
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "AdamW", "params": {**ADAMW, "torch_adam": True}}, "zero_optimization": zero,
              "bf16": {"enabled": bf16}, "gradient_clipping": 0.0}  # the reference is unclipped AdamW
    engine, *_ = ds_all.initialize(model=model, config=config)
    if bf16:
        with torch.no_grad():
            for p in reference.parameters():
                p.copy_(p.bfloat16().float())
    optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    tolerance = {"rtol": 5e-2, "atol": 5e-3} if bf16 else {"rtol": 1e-5, "atol": 1e-6}
    params, reference_params = list(model.parameters()), list(reference.parameters())
    dtype = torch.bfloat16 if bf16 else torch.float32
    out = {}
    for step in range(3):
        for micro in range(GAS):
            x, y = _batch(step, micro, rank)
            engine.backward(F.mse_loss(engine(x.to(dtype)).float(), y))
            if engine.is_gradient_accumulation_boundary():
                grads = [safe_get_full_grad(p) for p in params]
            engine.step()
        if stage == 3:
            before = engine.optimizer.memory_bytes()
            engine.empty_partition_cache()
            after = engine.optimizer.memory_bytes()
            out.setdefault("released", []).append(
                (all(p.numel() == 0 and p.ds_status == ds_zero.ZeroParamStatus.NOT_AVAILABLE for p in params),
                 after["buffers"] < before["buffers"], after["params"] <= before["params"]))
        expected = _reference_step(reference, optimizer, step, world_size)
        for got, want in zip(grads, expected, strict=True):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, **tolerance)
        for p, q in zip(params, reference_params, strict=True):
            torch.testing.assert_close(safe_get_full_fp32_param(p), q.detach(), **tolerance)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(safe_get_full_optimizer_state(p, key), optimizer.state[q][key], **tolerance)
        if step == 1:  # the last layer's weight set to zeros: the next forward outputs its bias
            safe_set_full_fp32_param(params[2], torch.zeros(1, 16))
            with torch.no_grad():
                reference_params[2].zero_()
                output = engine(torch.randn(3, 8).to(dtype)).float()
            bias = safe_get_full_fp32_param(params[3])
            out["bias_only"] = torch.equal(output, bias.to(dtype).float().expand(3, 1))
    gathered = torch.zeros(1)
    ds_comm.all_reduce(gathered)  # every rank got here
    return out


@pytest.mark.parametrize("stage,bf16", [(2, True), (3, False), (3, True)], ids=["stage2-bf16", "stage3", "stage3-bf16"])
def test_engine_state_access_is_ddp_and_adamw(stage, bf16):
    for result in spawn(train, world_size=2, args=(stage, bf16), timeout=240):
        assert result["bias_only"]
        if stage == 3:
            assert result["released"] == [(True, True, True)] * 3
