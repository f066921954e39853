"""Progressive layer dropping: DeepSpeed's theta schedule and the block wrapper."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from ds_data import ProgressiveLayerDrop, ProgressiveLayerDropBlock, ProgressiveLayerDropConfig


@pytest.mark.parametrize(("theta", "gamma"), [(0.5, 0.001), (0.8, 0.01), (1.0, 0.001), (0.25, 0.0), (0.5, 1.0),
                                             (0, 0.001)])  # theta 0: DeepSpeed's test_pld_schedule takes it
def test_theta_schedule_is_deepspeeds_formula_at_many_steps(theta, gamma):
    pld = ProgressiveLayerDrop(theta=theta, gamma=gamma)
    assert pld.get_theta() == 1.0 and pld.get_state() == {"progressive_layer_drop": True, "pld_theta": 1.0}
    for step in [*range(0, 200), 500, 1000, 5000, 10 ** 5]:
        pld.update_state(step)
        expected = (1.0 - theta) * np.exp(-gamma * step) + theta
        assert pld.get_theta() == float(expected)
        assert math.isclose(pld.get_theta(), (1.0 - theta) * math.exp(-gamma * step) + theta, rel_tol=1e-15)
        assert pld.get_state() == {"progressive_layer_drop": True, "pld_theta": pld.get_theta()}
    if gamma > 0:
        assert abs(pld.get_theta() - theta) < 1e-6 * max(1.0, 1.0 / gamma) or gamma * 10 ** 5 < 20


def test_defaults_and_state_round_trip():
    pld = ProgressiveLayerDrop()
    assert (pld.theta, pld.gamma) == (0.5, 0.001)
    pld.update_state(700)
    other = ProgressiveLayerDrop(theta=0.9, gamma=0.5)
    other.load_state_dict(pld.state_dict())
    assert other.state_dict() == pld.state_dict() and other.get_theta() == pld.get_theta()
    with pytest.raises(ValueError, match="current_theta"):
        other.load_state_dict({"theta": 0.5, "gamma": 0.1, "current_theta": 2.0})
    section = ProgressiveLayerDropConfig.from_ds_config({"progressive_layer_drop": {"enabled": True}})
    assert (section.theta, section.gamma) == (1.0, 0.001)  # DeepSpeed's config defaults
    assert section.params() == {"theta": 1.0, "gamma": 0.001}


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"theta": -0.1}, "progressive_layer_drop.theta must be in [0, 1]"),
    ({"theta": 1.5}, "got 1.5"),
    ({"gamma": -0.1}, "progressive_layer_drop.gamma must be a number >= 0, got -0.1"),
])
def test_bad_values_are_named(kwargs, words):
    with pytest.raises(ValueError) as error:
        ProgressiveLayerDrop(**kwargs)
    assert words in str(error.value)
    with pytest.raises(ValueError) as error:
        ProgressiveLayerDropConfig.from_ds_config({"progressive_layer_drop": {"enabled": True, **kwargs}})
    assert words in str(error.value)
    with pytest.raises(ValueError, match="did you mean 'theta'"):
        ProgressiveLayerDropConfig.from_ds_config({"progressive_layer_drop": {"thetta": 0.5}})


class Block(nn.Module):
    """A pre-LN residual block: x + mlp(ln(x))."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class Net(nn.Module):
    def __init__(self, dim: int = 8, layers: int = 4, pld: bool = False) -> None:
        super().__init__()
        blocks = [Block(dim) for _ in range(layers)]
        self.blocks = nn.ModuleList(ProgressiveLayerDropBlock(b, i, layers) for i, b in enumerate(blocks)) \
            if pld else nn.ModuleList(blocks)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, **kwargs):
        for block in self.blocks:
            x = self.drop(block(x, **kwargs))
        return x


def test_theta_one_is_the_plain_model_exactly():
    torch.manual_seed(0)
    plain = Net()
    wrapped = Net(pld=True)
    wrapped.blocks = nn.ModuleList(ProgressiveLayerDropBlock(b, i, 4) for i, b in enumerate(plain.blocks))
    x = torch.randn(3, 5, 8, requires_grad=True)
    for train in (True, False):
        plain.train(train), wrapped.train(train)
        torch.manual_seed(1)
        a = plain(x)
        ga = torch.autograd.grad(a.square().sum(), [x, *plain.parameters()])
        torch.manual_seed(1)
        b = wrapped(x, pld_theta=1.0, progressive_layer_drop=True)
        gb = torch.autograd.grad(b.square().sum(), [x, *wrapped.parameters()])
        assert torch.equal(a, b)  # dropout drew the same numbers: the wrapper drew none
        assert all(torch.equal(u, v) for u, v in zip(ga, gb, strict=True))


class Shift(nn.Module):
    """A cheap residual block: x + 1."""

    def forward(self, x):
        return x + 1


def test_deeper_layers_are_dropped_more_often_at_the_papers_rate():
    torch.manual_seed(0)
    layers, theta, samples = 4, 0.5, 4000
    calls = [0] * layers
    blocks = []
    for i in range(layers):
        block = Shift()
        block.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        blocks.append(ProgressiveLayerDropBlock(block, i, layers, generator=torch.Generator().manual_seed(i)))
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(samples):
            for block in blocks:
                block(x, pld_theta=theta)
    rates = [c / samples for c in calls]
    expected = [1 - (i + 1) / layers * (1 - theta) for i in range(layers)]  # 0.875, 0.75, 0.625, 0.5
    assert rates == sorted(rates, reverse=True)
    for rate, p in zip(rates, expected, strict=True):
        assert abs(rate - p) < 4 * math.sqrt(p * (1 - p) / samples), (rates, expected)
    for block in blocks:  # evaluation: always kept
        block.eval()
    before = list(calls)
    for block in blocks:
        block(x, pld_theta=theta)
    assert [c - b for c, b in zip(calls, before, strict=True)] == [1] * layers


def test_a_kept_block_rescales_its_residual_branch_and_a_dropped_one_is_the_identity():
    torch.manual_seed(0)
    block = Block(6)
    x = torch.randn(2, 6)
    plain = block(x)
    outs = set()
    wrapper = ProgressiveLayerDropBlock(block, 3, 4, generator=torch.Generator().manual_seed(0))
    p = 1 - 4 / 4 * (1 - 0.6)
    for _ in range(50):
        out = wrapper(x, pld_theta=0.6)
        if torch.equal(out, x):
            outs.add("skipped")
        else:
            torch.testing.assert_close(out, x + (plain - x) / p, rtol=0, atol=1e-6)
            outs.add("kept")
    assert outs == {"skipped", "kept"}
    assert torch.equal(wrapper(x), plain)  # no theta: the block
    with pytest.raises(ValueError, match="pld_theta must be a number in"):
        wrapper(x, pld_theta=0.0)
    with pytest.raises(ValueError, match="layer_index must be in"):
        ProgressiveLayerDropBlock(block, 4, 4)
