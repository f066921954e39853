"""``deepspeed.moe.sharded_moe`` (``ds_all.moe.sharded_moe``): its module-level names are the objects ds-moe runs
through, so what DeepSpeed's own tests patch there (``_AllToAll.apply``, ``dist.all_reduce``) is what the MoE
layer and the gating functions really call."""

from __future__ import annotations

import pytest
import torch

import ds_all
import ds_comm
import ds_moe
from ds_all.moe import sharded_moe
from ds_comm.testing import spawn


@pytest.mark.parametrize("name, owner", [("_AllToAll", ds_moe.AllToAll), ("_route_slots", ds_moe.route_slots),
                                         ("_sparse_encode", ds_moe.sparse_encode),
                                         ("_sparse_decode", ds_moe.sparse_decode), ("dist", ds_comm)])
def test_names_are_ds_moes_objects(name, owner):
    assert getattr(sharded_moe, name) is owner


def _count_collectives(rank, world_size):
    """DeepSpeed's TestMoESingleton, in ds's terms: count the calls through the patched module attributes."""
    out = {}
    single = [ds_comm.new_group([r]) for r in range(world_size)][rank]
    both = ds_comm.new_group(list(range(world_size)))
    original_all_reduce = sharded_moe.dist.all_reduce
    for name, group in (("single", single), ("both", both)):
        calls = []

        def counted(tensor, op=ds_comm.ReduceOp.SUM, group=None, calls=calls):
            calls.append((op, group))
            return original_all_reduce(tensor, op=op, group=group)

        sharded_moe.dist.all_reduce = counted
        try:
            logits = torch.randn(8, 4)
            sharded_moe.top1gating(logits, 1, 0, drop_tokens=False, ep_group=group)
            sharded_moe.top2gating(logits.clone(), 1, 0, drop_tokens=False, ep_group=group)
            sharded_moe.topkgating(logits, 3, 1, 0, drop_tokens=False, ep_group=group)
        finally:
            sharded_moe.dist.all_reduce = original_all_reduce
        out[name] = [(op == ds_comm.ReduceOp.MAX, g is group) for op, g in calls]

    torch.manual_seed(0)
    for ep_size in (1, 2):
        model = ds_moe.MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2, ep_size=ep_size, k=1,
                           min_capacity=0)
        engine, *_ = ds_all.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                       config={"train_micro_batch_size_per_gpu": 1}, dist_init_required=False)
        shapes = []

        def identity(group, input, shapes=shapes):
            shapes.append(tuple(input.shape))
            return input

        sharded_moe._AllToAll.apply = identity
        try:
            x = torch.randn(1, 4, 8, requires_grad=True)
            output, l_aux, _ = engine(x)
            engine.backward(output.sum() + l_aux)
        finally:
            del sharded_moe._AllToAll.apply  # torch.autograd.Function.apply again
        out[f"a2a ep{ep_size}"] = (shapes, x.grad is not None)
    return out


def test_patching_the_deepspeed_module_attributes_reaches_ds_moe():
    for got in spawn(_count_collectives, world_size=2):
        assert got["single"] == []  # a one-rank expert group needs no agreement on the capacity
        assert got["both"] == [(True, True)] * 3  # one MAX all-reduce over the expert group per gating call
        assert got["a2a ep1"] == ([], True)
        # ep_size 2, 2 experts, 4 tokens at capacity 2: the [E, C, M] buffer out to the experts and back
        assert got["a2a ep2"] == ([(2, 2, 8), (2, 2, 8)], True)
