"""A 16-bit model with neither an fp16 nor a bf16 section through `ds_all.initialize`, on 2 ranks, against
DeepSpeed 0.19.8's own numbers for the same script: measured with /work/dsref (``DS_ACCELERATOR=cpu
torchrun --nproc_per_node 2``): this model (seed 0, ``.half()`` or ``.to(torch.bfloat16)``), this data
(generator seed 1, 2 samples per rank), AdamW lr 0.01 without weight decay, ``zero_optimization.stage``
as below, printing rank 0's loss, ``optimizer.loss_scale`` and the first layer's weight after each step.
DeepSpeed trains it with a float32 master copy (the fp16 one with the fp16 section's default dynamic loss
scale: the first two steps overflow at 2^16 and are skipped); its weights are compared through the first
update (ds-zero's README, Differences, for later steps)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_all
import ds_zero
from ds_comm.testing import spawn

# (loss each step, loss scale after each step, skipped steps, index of the first update, the first layer's
# weight's first 4 elements after it), DeepSpeed 0.19.8's, identical at stages 1, 2 and 3
DEEPSPEED = {
    "fp16": ([0.8896484375, 2.384765625, 1.015625, 0.263916015625], [65536.0, 32768.0, 32768.0, 32768.0], 2, 2,
             [0.006256103515625, 0.2783203125, -0.401611328125, -0.35791015625]),
    "bf16": ([0.88671875, 2.40625, 0.9609375, 0.287109375], [1.0, 1.0, 1.0, 1.0], 0, 0,
             [-0.01373291015625, 0.2578125, -0.421875, -0.376953125]),
}


def train(rank, world_size, precision, stage):
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    engine, optimizer, _, _ = ds_all.initialize(
        model=model, model_parameters=model.parameters(), config=config,
        optimizer=lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.0))
    g = torch.Generator().manual_seed(1)
    losses, scales, weights = [], [], []
    for _ in range(4):
        x = torch.randn(4, 4, generator=g)[2 * rank:2 * rank + 2].to(dtype)
        y = torch.randn(4, 2, generator=g)[2 * rank:2 * rank + 2].to(dtype)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        scales.append(optimizer.loss_scale)
        with ds_zero.GatheredParameters([model[0].weight]):
            weights.append(model[0].weight.detach().flatten()[:4].tolist())
    return losses, scales, engine.skipped_steps, weights


@pytest.mark.parametrize(("precision", "stage"), [("fp16", 2), ("bf16", 1), ("bf16", 3)])
def test_a_16_bit_model_without_a_section_trains_as_deepspeed(precision, stage):
    losses, scales, skipped, weights = spawn(train, world_size=2, args=(precision, stage))[0]
    ds_losses, ds_scales, ds_skipped, first, ds_weight = DEEPSPEED[precision]
    assert scales == ds_scales and skipped == ds_skipped
    assert losses[:first + 2] == ds_losses[:first + 2]
    assert weights[first] == ds_weight
