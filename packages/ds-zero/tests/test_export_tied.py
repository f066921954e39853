"""A model with tied weights (``layer2.weight = layer1.weight``): its ZeRO checkpoint records the alias as
DeepSpeed's does (``shared_params``: the name not stored -> the name holding the data), and the consolidated
float32 state dict has every name of the model's ``state_dict()`` (the alias the same tensor), so a strict
``load_state_dict`` works and gives the trained model's outputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ds_comm.testing import spawn
from ds_zero import (
    ZeroOptimizer,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    read_zero_metadata,
    save_zero_checkpoint,
)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer1 = nn.Linear(4, 4)
        self.layer2 = nn.Linear(4, 4)
        self.layer2.weight = self.layer1.weight
        self.register_buffer("offset", torch.arange(4.0))

    def forward(self, x):
        return self.layer2(torch.tanh(self.layer1(x))) + self.offset


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))


def train_and_save(rank, world_size, stage, path):
    model = Tied()
    reference = copy.deepcopy(model)  # plain PyTorch, the ranks' data averaged as DDP does
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={"lr": 0.05}, config={"stage": stage})
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for step in range(3):
        zero.backward(model(_x(rank, step)).square().mean())
        zero.step()
        zero.zero_grad()
        optimizer.zero_grad()
        for r in range(world_size):
            (reference(_x(r, step)).square().mean() / world_size).backward()
        optimizer.step()
    save_zero_checkpoint(zero, path)
    return {k: v.detach().clone() for k, v in reference.state_dict().items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_export_of_tied_weights_has_every_name(stage, tmp_path):
    expected = spawn(train_and_save, world_size=2, args=(stage, str(tmp_path)))[0]
    assert read_zero_metadata(tmp_path)["shared_params"] == {"layer2.weight": "layer1.weight"}
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert set(state) == set(Tied().state_dict()) == set(expected)
    assert state["layer2.weight"] is state["layer1.weight"]
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)
    fresh = load_state_dict_from_zero_checkpoint(Tied(), tmp_path)
    assert fresh.layer2.weight is fresh.layer1.weight
    x = _x(0, 9)
    reference = Tied()
    reference.load_state_dict(expected)
    torch.testing.assert_close(fresh(x), reference(x), rtol=1e-5, atol=1e-6)
