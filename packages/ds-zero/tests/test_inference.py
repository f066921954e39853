"""`ZeroInference` (stage 3 without an optimizer) and `Init` of modules built on the meta device
(``torch.nn.utils.skip_init``), on 2 ranks against plain PyTorch modules."""

from __future__ import annotations

import torch
from torch import nn

import ds_zero
from ds_comm.testing import spawn

ZERO = {"stage": 3, "stage3_param_persistence_threshold": 0}


class Block(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.a = nn.Linear(4, 6, device=device)
        self.b = nn.Linear(6, 4, device=device)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def skip_init_under_init(rank, world_size):
    with ds_zero.Init():
        linear = torch.nn.utils.skip_init(nn.Linear, 8, 8)
        block = torch.nn.utils.skip_init(Block)
    # as DeepSpeed's Init: each parameter empty, its shard in ds_tensor
    out = {"partitioned": [(tuple(p.ds_shape), p.numel(), p.ds_tensor.numel(), p.is_meta) for p in linear.parameters()],
           "block": [(tuple(p.ds_shape), p.numel(), p.ds_tensor.numel(), p.is_meta) for p in block.parameters()],
           "hooks_left": [m for m in [*linear.modules(), *block.modules()] if "to_empty" in m.__dict__]}
    torch.manual_seed(1)
    plain, plain_block = nn.Linear(8, 8), Block()
    for module, reference in ((linear, plain), (block, plain_block)):
        with ds_zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
            out.setdefault("shapes", []).append([tuple(p.shape) for p in module.parameters()])
            if rank == 0:
                with torch.no_grad():
                    for p, q in zip(module.parameters(), reference.parameters(), strict=True):
                        p.copy_(q)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    y = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    zero = ds_zero.ZeroInference(linear, config=ZERO)
    block_zero = ds_zero.ZeroInference(block, config=ZERO)
    with torch.no_grad():
        out["equal"] = [torch.equal(linear(x), plain(x)), torch.equal(block(y), plain_block(y))]
    out["released"] = [p.numel() for p in [*linear.parameters(), *block.parameters()]]
    zero.close()
    block_zero.close()
    out["closed"] = all(torch.equal(p, q) for p, q in zip([*linear.parameters(), *block.parameters()],
                                                           [*plain.parameters(), *plain_block.parameters()],
                                                           strict=True))
    return out


def test_skip_init_under_init_partitions_the_module_at_to_empty():
    for out in spawn(skip_init_under_init, world_size=2):
        assert out["partitioned"] == [((8, 8), 0, 32, False), ((8,), 0, 4, False)]
        assert out["block"] == [((6, 4), 0, 12, False), ((6,), 0, 3, False), ((4, 6), 0, 12, False),
                                ((4,), 0, 2, False)]
        assert out["hooks_left"] == []
        assert out["shapes"] == [[(8, 8), (8,)], [(6, 4), (6,), (4, 6), (4,)]]
        assert out["equal"] == [True, True]
        assert out["released"] == [0, 0, 0, 0, 0, 0]
        assert out["closed"]


def refusals(rank, world_size):
    messages = []
    for config in ({"stage": 2}, {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}):
        try:
            ds_zero.ZeroInference(nn.Linear(2, 2), config=config)
        except (ValueError, NotImplementedError) as e:
            messages.append(str(e))
    model = nn.Linear(2, 2)
    zero = ds_zero.ZeroInference(model, config=ZERO)
    try:
        ds_zero.ZeroInference(model, config=ZERO)
    except ValueError as e:
        messages.append(str(e))
    zero.close()
    return messages


def test_zero_inference_refuses_what_it_does_not_do():
    for messages in spawn(refusals, world_size=2):
        assert len(messages) == 3
        assert "stage 3, got stage 2" in messages[0]
        assert "offload_param.device 'nvme'" in messages[1]
        assert "managed by another stage-3" in messages[2]


def skip_init_trains(rank, world_size):
    with ds_zero.Init():
        linear = torch.nn.utils.skip_init(nn.Linear, 8, 8)
    torch.manual_seed(2)
    plain = nn.Linear(8, 8)
    with ds_zero.GatheredParameters(list(linear.parameters()), modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                for p, q in zip(linear.parameters(), plain.parameters(), strict=True):
                    p.copy_(q)
    zero = ds_zero.ZeroOptimizer(linear, torch.optim.SGD, optimizer_kwargs={"lr": 0.5}, config=ZERO)
    inputs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    zero.backward(linear(inputs[rank]).square().mean())
    zero.step()
    # the reference: SGD on the gradient averaged over the ranks' inputs (DDP's)
    loss = sum(plain(x).square().mean() for x in inputs) / world_size
    loss.backward()
    with torch.no_grad():
        for p in plain.parameters():
            p -= 0.5 * p.grad
    zero.close()
    return [torch.allclose(p, q, rtol=1e-6, atol=1e-7) for p, q in zip(linear.parameters(), plain.parameters(),
                                                                        strict=True)]


def test_a_skip_init_module_under_init_trains_at_stage_3():
    for close in spawn(skip_init_trains, world_size=2):
        assert close == [True, True]
