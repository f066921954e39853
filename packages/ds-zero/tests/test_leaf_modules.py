"""ZeRO-3 leaf modules (DeepSpeed's ``set_z3_leaf_modules`` and ``zero_optimization.leaf_module``): a
Mixture-of-Experts block whose ranks route to different experts trains when the block is a leaf (one unit,
gathered whole on every rank), equal to plain PyTorch on the same data, and is stopped by stage 3's path check
when it is not (each expert its own unit, asked for by one rank only)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ds_comm.testing import RankFailed, spawn
from ds_zero import (
    ZeroOptimizer,
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)


class SparseBlock(nn.Module):
    """Routes the whole batch to one expert, chosen by the data (so ranks choose differently)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        choice = int(x.sum().abs().item() * 1000) % len(self.experts)
        return self.experts[choice](x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 4)
        self.moe = SparseBlock()
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.moe(self.inp(x))))


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def train(rank, world_size, how):
    model = Net()
    reference = copy.deepcopy(model)
    if how == "call":
        assert [type(m).__name__ for m in set_z3_leaf_modules(model, [SparseBlock])] == ["SparseBlock"]
        config = {"stage": 3, "stage3_param_persistence_threshold": 0}
    elif how == "config":
        config = {"stage": 3, "stage3_param_persistence_threshold": 0, "leaf_module": {"classes": ["SparseBlock"]}}
    else:
        config = {"stage": 3, "stage3_param_persistence_threshold": 0}
    zero = ZeroOptimizer(model, torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, config=config)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    flagged = z3_leaf_module(model.moe) and all(z3_leaf_parameter(p) for p in model.moe.parameters())
    losses, want = [], []
    for step in range(3):
        loss = model(_x(rank, step)).square().mean()
        zero.backward(loss)
        zero.step()
        zero.zero_grad()
        losses.append(loss.item())
        optimizer.zero_grad()
        total = 0.0
        for r in range(world_size):  # DDP's average over the ranks' batches
            part = reference(_x(r, step)).square().mean()
            (part / world_size).backward()
            total = part.item() if r == rank else total
        optimizer.step()
        want.append(total)
    zero.close()
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(model.parameters(), reference.parameters(),
                                                                           strict=True))
    return flagged, losses, want, same


@pytest.mark.parametrize("how", ["call", "config"])
def test_a_leaf_moe_block_trains_as_plain_pytorch(how):
    choices = {int(_x(r, s).sum().abs().item() * 1000) % 3 for r in range(2) for s in range(3)}
    assert len(choices) > 1  # the ranks route differently: the case leaf modules exist for
    for flagged, losses, want, same in spawn(train, world_size=2, args=(how,)):
        assert flagged and same
        assert losses == pytest.approx(want, rel=1e-5)


def test_without_a_leaf_the_ranks_diverging_experts_are_named():
    with pytest.raises(RankFailed, match="took different paths"):
        spawn(train, world_size=2, args=("none",))


def test_flags_by_class_name_and_suffix_and_their_errors():
    model = Net()
    assert set_z3_leaf_modules(model, [f"{SparseBlock.__module__}.SparseBlock"]) == [model.moe]  # the dotted path
    assert set_z3_leaf_modules(model, ["SparseBlock"]) == [model.moe]
    assert get_z3_leaf_modules(model) == [model.moe]
    assert unset_z3_leaf_modules(model, [SparseBlock]) == [model.moe] and get_z3_leaf_modules(model) == []
    assert set_z3_leaf_modules_by_name(model, ["moe.experts.0"]) == ([model.moe.experts[0]], [])
    assert set_z3_leaf_modules_by_suffix(model, ["experts.1"], raise_if_not_found=False) == \
        ([model.moe.experts[1]], [])
    with pytest.raises(ValueError, match="no module of the classes"):
        set_z3_leaf_modules(model, [nn.Conv2d])
    with pytest.raises(ValueError, match="no modules named"):
        set_z3_leaf_modules_by_name(model, ["nope"])
    with pytest.raises(ValueError, match="must be a list of module classes or class names"):
        set_z3_leaf_modules(model, [3])
