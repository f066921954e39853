"""Megatron's four autograd functions on 2 ranks against their arithmetic, forward and backward; and the
identity they are with one rank (no process group)."""

import pytest
import torch

import ds_comm
from ds_comm.testing import spawn
from ds_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

FUNCTIONS = [copy_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region,
             reduce_from_tensor_model_parallel_region, scatter_to_tensor_model_parallel_region]


def per_rank(rank, shape):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(*shape, generator=g)


def check_mappings(rank, world_size):
    close = torch.testing.assert_close
    others = [per_rank(r, (3, 2, 4)) for r in range(world_size)]  # what every rank holds, known to all
    grads = [per_rank(100 + r, (3, 2, 4)) for r in range(world_size)]
    wide_grads = [per_rank(200 + r, (3, 2, 8)) for r in range(world_size)]

    # copy: identity forward, sum of the gradients backward
    x = others[rank].clone().requires_grad_()
    y = copy_to_tensor_model_parallel_region(x)
    close(y, others[rank])
    y.backward(grads[rank])
    close(x.grad, sum(grads))

    # reduce: sum forward, identity backward; the input is not reduced in place
    x = others[rank].clone().requires_grad_()
    y = reduce_from_tensor_model_parallel_region(x)
    close(y, sum(others))
    close(x.detach(), others[rank])
    y.backward(grads[rank])
    close(x.grad, grads[rank])

    # scatter: keep this rank's last-dim chunk forward, all-gather the gradient backward
    full = per_rank(7, (3, 2, 8))  # the same on every rank
    x = full.clone().requires_grad_()
    y = scatter_to_tensor_model_parallel_region(x)
    close(y, full[..., rank * 4:(rank + 1) * 4])
    assert y.is_contiguous()
    y.backward(grads[rank])
    close(x.grad, torch.cat(grads, dim=-1))

    # gather: all-gather the last dim forward (rank order), keep this rank's chunk of the gradient backward
    x = others[rank].clone().requires_grad_()
    y = gather_from_tensor_model_parallel_region(x)
    close(y, torch.cat(others, dim=-1))
    y.backward(wide_grads[rank])
    close(x.grad, wide_grads[rank][..., rank * 4:(rank + 1) * 4])

    # an explicit group (here: every rank) behaves the same, and the collectives go through ds_comm
    group = ds_comm.new_group(list(range(world_size)))
    ds_comm.configure(enabled=True)
    ds_comm.comms_logger.reset()
    x = others[rank][..., :2].clone().requires_grad_()
    y = gather_from_tensor_model_parallel_region(x, group=group)
    close(y, torch.cat([o[..., :2] for o in others], dim=-1))
    z = reduce_from_tensor_model_parallel_region(y, group=group)
    close(z, world_size * torch.cat([o[..., :2] for o in others], dim=-1))
    seen = {r.op: r.count for r in ds_comm.comms_logger.records()}
    ds_comm.configure(enabled=False)
    assert seen == {"all_gather_into_tensor": 1, "all_reduce": 1}, seen

    # a last dimension the group cannot split is refused by name
    with pytest.raises(ValueError, match="not divisible"):
        scatter_to_tensor_model_parallel_region(torch.zeros(2, 3))
    return True


def test_mappings_two_ranks():
    assert spawn(check_mappings, world_size=2) == [True, True]


def test_single_rank_is_identity():
    # no process group: world size 1, every function passes its input (and gradient) through
    x = torch.randn(2, 4, requires_grad=True)
    for fn in FUNCTIONS:
        y = fn(x)
        torch.testing.assert_close(y, x)
        y.backward(torch.ones_like(y))
        torch.testing.assert_close(x.grad, torch.ones_like(x))
        x.grad = None


def test_bad_input_named():
    with pytest.raises(TypeError, match="copy_to_tensor_model_parallel_region"):
        copy_to_tensor_model_parallel_region([1.0, 2.0])
