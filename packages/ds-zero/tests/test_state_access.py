"""DeepSpeed's state-access API (``safe_get_full_fp32_param`` & co) on 2 ranks, against plain PyTorch: the
full gradient is DDP's (averaged over the ranks, each micro-step divided by the accumulation steps), the full
master weights and Adam states are those of ``torch.optim.AdamW`` stepped on the same data, the setters change
what the next forward uses and what the next step starts from, and the local variants are this rank's piece
of a ZeRO-3 parameter, at stages 0-3, in float32 and bf16 (master copy), with the optimizer on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ds_comm
from ds_comm.testing import spawn
from ds_zero import (
    ZeroOptimizer,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)

GAS = 2
ADAMW = {"lr": 0.05, "weight_decay": 0.01}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _x(rank: int, step: int, micro: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))


def _config(stage: int, offload: str, path: str) -> dict:
    config = {"stage": stage}
    if stage == 3:
        config["stage3_param_persistence_threshold"] = 0  # every unit partitioned
    if offload:
        device = "cpu" if offload == "cpu" else "nvme"
        config["offload_optimizer"] = {"device": device, "nvme_path": path}
        if offload == "nvme-params":
            config["offload_param"] = {"device": "nvme", "nvme_path": path}
    return config


def _reference_grads(reference: nn.Module, rank: int, world_size: int, step: int) -> list[torch.Tensor]:
    """DDP's gradient of this step on the reference (float32): each micro-step's loss / GAS, summed over the
    micro-steps and averaged over the ranks."""
    reference.zero_grad()
    for micro in range(GAS):
        (reference(_x(rank, step, micro)).square().mean() / GAS).backward()
    grads = []
    for p in reference.parameters():
        g = p.grad.clone()
        ds_comm.all_reduce(g)
        grads.append(g / world_size)
        p.grad.copy_(grads[-1])
    return grads


def access(rank, world_size, stage, precision, offload, path):
    reference = _model()
    model = copy.deepcopy(reference)
    bf16 = precision == "bf16"
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config=_config(stage, offload, path),
                         bf16={"enabled": bf16}, gradient_accumulation_steps=GAS)
    if bf16:  # the master copy starts from the bf16 model's values, as DeepSpeed's
        with torch.no_grad():
            for p in reference.parameters():
                p.copy_(p.bfloat16().float())
    reference_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    tolerance = {"rtol": 3e-2, "atol": 3e-3} if bf16 else {"rtol": 1e-5, "atol": 1e-6}
    out = {}
    params, reference_params = list(model.parameters()), list(reference.parameters())

    out["fp32_start"] = all(torch.equal(safe_get_full_fp32_param(p), q) for p, q in zip(params, reference_params, strict=True))
    if offload in ("nvme", "nvme-params"):  # ZeRO-Infinity's states exist (zeros) from the start
        assert not safe_get_full_optimizer_state(params[0], "exp_avg").any()
    else:
        with pytest.raises(RuntimeError, match="no state yet"):
            safe_get_full_optimizer_state(params[0], "exp_avg")
    with pytest.raises(RuntimeError, match="after a backward and before the step"):
        safe_get_full_grad(params[0])

    # step 0: gradients at each micro-step, then AdamW's states and weights
    first_micro = None
    for micro in range(GAS):
        zero.backward(model(_x(rank, 0, micro).to(model[0].weight.dtype)).float().square().mean())
        if micro == 0:
            first_micro = [safe_get_full_grad(p) for p in params]
        if micro == GAS - 1:
            grads = [safe_get_full_grad(p) for p in params]
            local_grads = [safe_get_local_grad(p) for p in params] if stage == 3 else None
        zero.step()
    expected = _reference_grads(reference, rank, world_size, 0)
    # at micro-step 0 stages 0-1 hold this rank's own gradient (not reduced yet), stages 2-3 the reduced one
    probe = _model()
    with torch.no_grad():
        for p in probe.parameters():
            p.copy_(p.bfloat16().float() if bf16 else p)
    (probe(_x(rank, 0, 0)).square().mean() / GAS).backward()
    micro0 = [p.grad.clone() for p in probe.parameters()]
    if stage >= 2:
        for g in micro0:
            ds_comm.all_reduce(g)
            g /= world_size
    for got, want in zip(first_micro, micro0, strict=True):
        torch.testing.assert_close(got, want, **tolerance)
    for got, want in zip(grads, expected, strict=True):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, **tolerance)
    reference_optimizer.step()
    for p, q in zip(params, reference_params, strict=True):
        torch.testing.assert_close(safe_get_full_fp32_param(p), q.detach(), **tolerance)
        for key in ("exp_avg", "exp_avg_sq"):
            state = safe_get_full_optimizer_state(p, key)
            assert state.dtype == torch.float32 and state.shape == q.shape
            torch.testing.assert_close(state, reference_optimizer.state[q][key], **tolerance)
    with pytest.raises(ValueError, match="'step'"):
        safe_get_full_optimizer_state(params[0], "step")
    with pytest.raises(RuntimeError, match="after a backward and before the step"):
        safe_get_full_grad(params[0])

    # local pieces (stage 3): this rank's part of the whole, as many elements as ds_tensor
    if stage == 3:
        for p in params:
            local = safe_get_local_fp32_param(p)
            assert local.numel() == p.ds_tensor.ds_numel  # (an empty placeholder when the shard is on NVMe)
            lengths = [None] * world_size
            torch.distributed.all_gather_object(lengths, local.numel())
            start = sum(lengths[:rank])
            assert sum(lengths) == p.ds_numel
            assert torch.equal(local, safe_get_full_fp32_param(p).reshape(-1)[start:start + local.numel()])
            assert torch.equal(safe_get_local_optimizer_state(p, "exp_avg"),
                               safe_get_full_optimizer_state(p, "exp_avg").reshape(-1)[start:start + local.numel()])
        for local, full_grad in zip(local_grads, grads, strict=True):
            lengths = [None] * world_size
            torch.distributed.all_gather_object(lengths, local.numel())
            start = sum(lengths[:rank])
            assert torch.equal(local, full_grad.reshape(-1)[start:start + local.numel()])
        # set local: each rank writes its piece; the whole is the concatenation
        weight = params[0]
        local = safe_get_local_fp32_param(weight)
        safe_set_local_fp32_param(weight, torch.full_like(local, 0.125 * (rank + 1)))
        safe_set_local_optimizer_state(weight, torch.full_like(local, 0.001 * (rank + 1)), "exp_avg")
        lengths = [None] * world_size
        torch.distributed.all_gather_object(lengths, local.numel())
        pattern = torch.cat([torch.full((n,), float(r + 1)) for r, n in enumerate(lengths)]).view(weight.ds_shape)
        moment = pattern * 0.001
        pattern = pattern * 0.125
        out["local_set"] = (torch.equal(safe_get_full_fp32_param(weight), pattern),
                            torch.equal(safe_get_full_optimizer_state(weight, "exp_avg"), moment))
        with torch.no_grad():
            reference_params[0].copy_(pattern)
            reference_optimizer.state[reference_params[0]]["exp_avg"].copy_(moment)
    else:
        with pytest.raises(ValueError, match="ZeRO-3 partitioned parameters"):
            safe_get_local_fp32_param(params[0])

    # set the full weights and Adam's first moment: the next forward and step use them
    weight = params[2]  # the second Linear's weight, split between the ranks
    value = torch.linspace(-1, 1, weight_numel := reference_params[2].numel()).view(reference_params[2].shape)
    safe_set_full_fp32_param(weight, value)
    moment = torch.linspace(0, 0.01, weight_numel).view(value.shape)
    safe_set_full_optimizer_state(weight, moment, "exp_avg")
    with torch.no_grad():
        reference_params[2].copy_(value)
        reference_optimizer.state[reference_params[2]]["exp_avg"].copy_(moment)
    out["set_exact"] = torch.equal(safe_get_full_fp32_param(weight), value)  # the master holds it in float32
    x = _x(rank, 1, 0)
    with torch.no_grad():
        got = model(x.to(model[0].weight.dtype)).float()
        want = reference(x.bfloat16().float() if bf16 else x)
    torch.testing.assert_close(got, want, **({"rtol": 3e-2, "atol": 3e-2} if bf16 else tolerance))
    with pytest.raises(ValueError, match="value has 5 elements"):
        safe_set_full_fp32_param(weight, torch.zeros(5))

    # step 1 with a gradient set by hand: the step starts from the values set above
    zero.zero_grad()
    for micro in range(GAS):
        zero.backward(model(_x(rank, 1, micro).to(model[0].weight.dtype)).float().square().mean())
        if micro == GAS - 1:
            new_grad = torch.linspace(-0.3, 0.3, weight_numel).view(value.shape)
            safe_set_full_grad(weight, new_grad)
            out["grad_set"] = torch.equal(safe_get_full_grad(weight), new_grad) if not bf16 else \
                torch.equal(safe_get_full_grad(weight), new_grad.bfloat16().float())
            safe_update_full_grad_vectorized(params[:2], lambda g, p: g * 2)
        zero.step()
    _reference_grads(reference, rank, world_size, 1)
    with torch.no_grad():
        reference_params[2].grad.copy_(new_grad.bfloat16().float() if bf16 else new_grad)
        reference_params[0].grad.mul_(2)
        reference_params[1].grad.mul_(2)
    reference_optimizer.step()
    for p, q in zip(params, reference_params, strict=True):
        torch.testing.assert_close(safe_get_full_fp32_param(p), q.detach(), **tolerance)
        torch.testing.assert_close(safe_get_full_optimizer_state(p, "exp_avg"), reference_optimizer.state[q]["exp_avg"],
                                   **tolerance)

    # tensors ZeRO does not train: None, and setting them does nothing
    stray = nn.Parameter(torch.ones(3))
    out["stray"] = (safe_get_full_fp32_param(stray), safe_get_full_optimizer_state(stray, "exp_avg"),
                    safe_get_full_grad(stray), safe_set_full_fp32_param(stray, torch.zeros(3)), stray.sum().item())
    zero.close()
    out["closed"] = safe_get_full_fp32_param(params[0])
    return out


CASES = [(0, "fp32", ""), (1, "fp32", ""), (2, "fp32", ""), (3, "fp32", ""), (1, "bf16", ""), (2, "bf16", ""),
         (3, "bf16", ""), (2, "fp32", "cpu"), (3, "bf16", "cpu"), (3, "fp32", "nvme"), (3, "bf16", "nvme"),
         (3, "fp32", "nvme-params"), (3, "bf16", "nvme-params")]


@pytest.mark.parametrize("stage,precision,offload", CASES,
                         ids=[f"stage{s}-{p}{f'-{o}' if o else ''}" for s, p, o in CASES])
def test_state_access_matches_plain_pytorch(stage, precision, offload, tmp_path):
    for result in spawn(access, world_size=2, args=(stage, precision, offload, str(tmp_path)), timeout=240):
        assert result["fp32_start"] and result["set_exact"] and result["grad_set"]
        if stage == 3:
            assert result["local_set"] == (True, True)
        assert result["stray"] == (None, None, None, None, 3.0)
        assert result["closed"] is None
