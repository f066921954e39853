"""A 16-bit model (``model.half()``, ``model.to(torch.bfloat16)``) with neither an fp16 nor a bf16 section,
on 2 ranks, trained as DeepSpeed 0.19.8 trains it (see ds_zero/_half.py): stages 1-3 keep a float32
master copy, float16 gets the dynamic loss scale (2^16, hysteresis 2) and skips overflowed steps, bfloat16
no scale; stage 0 steps the 16-bit parameters themselves; gradients are averaged in float32.

Each run is compared bit for bit with a plain-PyTorch reference doing that arithmetic, and with DeepSpeed's
own numbers (the fixtures below), measured with /work/dsref (DeepSpeed 0.19.8, torch 2.13 CPU) by
``DS_ACCELERATOR=cpu torchrun --nproc_per_node 2`` of this test's model, data and config (AdamW lr 0.01, no
weight decay, ``torch_adam``, micro-batch 2 per rank, ``zero_optimization.stage`` 0-3 and no fp16/bf16
section), printing the loss, ``optimizer.loss_scale`` and the first layer's weight after each step.
DeepSpeed's losses, loss scales and skipped steps are these at stages 1, 2 and 3 alike; its weights equal
the plain-PyTorch arithmetic's through the first update (checked below) and are one or two 16-bit steps
apart in a few elements from the second on (its own bf16-section run is too: README, Differences)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_comm
from ds_comm.testing import spawn
from ds_zero import ZeroOptimizer

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
STEPS, LR = 4, 0.01
# DeepSpeed 0.19.8's numbers (see the module docstring): rank 0's loss each step, the loss scale after
# each step, skipped steps, and the first 4 elements of the first layer's weight after the step that
# made the first update (fp16: the third, the first two overflowed at 2^16; bf16: the first)
DEEPSPEED = {
    "fp16": {"losses": [0.8896484375, 2.384765625, 1.015625, 0.263916015625],
             "scales": [65536.0, 32768.0, 32768.0, 32768.0], "skipped": 2, "first_update": 2,
             "weight": [0.006256103515625, 0.2783203125, -0.401611328125, -0.35791015625]},
    "bf16": {"losses": [0.88671875, 2.40625, 0.9609375, 0.287109375],
             "scales": [1.0, 1.0, 1.0, 1.0], "skipped": 0, "first_update": 0,
             "weight": [-0.01373291015625, 0.2578125, -0.421875, -0.376953125]},
}
# stage 0 (bf16; DeepSpeed's CPU all-reduce refuses float16 gradients): its first two losses
DEEPSPEED_STAGE0_BF16_LOSSES = [0.88671875, 2.40625]


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)) for _ in range(STEPS)]


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def reference(dtype, stage):
    """Both ranks' micro-batches in one process: per-rank 16-bit gradients (of the scaled loss for
    float16), averaged in float32; stages 1-3: rounded to 16 bits, unscaled in float32 into a float32
    master copy stepped by torch's AdamW, cast back; stage 0: torch's AdamW on the 16-bit parameters."""
    model = _model(dtype)
    params = list(model.parameters())
    master = None if stage == 0 else [p.detach().float().clone().requires_grad_(True) for p in params]
    optimizer = torch.optim.AdamW(params if master is None else master, lr=LR, weight_decay=0.0)
    scale, hysteresis = (2.0 ** 16, 2) if dtype == torch.float16 and stage > 0 else (1.0, 0)
    losses, scales, weights, skipped = [], [], [], 0
    for x, y in _data():
        grads = []
        for rank in range(2):
            for p in params:
                p.grad = None
            loss = _loss(model, x[2 * rank:2 * rank + 2].to(dtype), y[2 * rank:2 * rank + 2].to(dtype))
            (loss.float() * scale if scale != 1.0 else loss).backward()
            losses += [loss.item()] if rank == 0 else []
            grads.append([p.grad.float() for p in params])
        averaged = [((a + b) / 2).to(dtype) for a, b in zip(*grads, strict=True)]
        if scale != 1.0 and not all(bool(g.isfinite().all()) for g in averaged):
            skipped += 1
            if hysteresis > 1:
                hysteresis -= 1
            else:
                scale /= 2
        else:
            for target, g in zip(params if master is None else master, averaged, strict=True):
                target.grad = g if master is None else g.float() / scale
            optimizer.step()
            if master is not None:
                with torch.no_grad():
                    for p, m in zip(params, master, strict=True):
                        p.copy_(m)
        scales.append(scale)
        weights.append(params[0].detach().flatten().tolist())
    return losses, scales, weights, skipped


def train(rank, world_size, precision, stage):
    dtype = DTYPES[precision]
    model = _model(dtype)
    config = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={"lr": LR, "weight_decay": 0.0}, config=config)
    master = [str(t.dtype) for t in zero._step_params]
    losses, scales, weights = [], [], []
    for x, y in _data():
        loss = _loss(model, x[2 * rank:2 * rank + 2].to(dtype), y[2 * rank:2 * rank + 2].to(dtype))
        zero.backward(loss)
        zero.step()
        zero.zero_grad()
        losses.append(loss.item())
        scales.append(zero.loss_scale)
        weights.append(zero.full_state_dict(rank0_only=False)["0.weight"].flatten().tolist())
    ds_comm.barrier()
    return losses, scales, weights, zero.skipped_steps, master, str(zero.communication_data_type)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_16_bit_model_without_a_section_trains_as_deepspeed_trains_it(precision, stage):
    expected = reference(DTYPES[precision], stage)
    results = spawn(train, world_size=2, args=(precision, stage))
    for rank, (losses, scales, weights, skipped, master, comm) in enumerate(results):
        assert comm == "torch.float32"
        assert (scales, weights, skipped) == (expected[1], expected[2], expected[3])
        if rank == 1:  # its own micro-batches' losses
            continue
        assert losses == expected[0]
        if stage == 0:  # no master copy: the optimizer steps the 16-bit parameters
            assert set(master) == {str(DTYPES[precision])}
            if precision == "bf16":
                assert losses[:2] == DEEPSPEED_STAGE0_BF16_LOSSES
            continue
        assert set(master) == {"torch.float32"}
        fixture = DEEPSPEED[precision]
        assert scales == fixture["scales"] and skipped == fixture["skipped"]
        assert losses[:fixture["first_update"] + 2] == fixture["losses"][:fixture["first_update"] + 2]
        assert weights[fixture["first_update"]][:4] == fixture["weight"]
