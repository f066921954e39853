"""deepspeed.moe.utils' functions: expert parameters told apart and grouped as DeepSpeed does."""

import pytest
import torch
from torch import nn

from ds_moe import (
    MoE,
    configure_moe_param_groups,
    expert_checkpoint_names,
    has_moe_layers,
    is_moe_param,
    is_moe_param_group,
    split_params_grads_into_shared_and_expert_params,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)


class Net(nn.Module):
    def __init__(self, ep_sizes=(1,), num_experts=2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 4)
        self.layers = nn.ModuleList(MoE(4, nn.Linear(4, 4), num_experts=num_experts, ep_size=ep) for ep in ep_sizes)


def ids(params):
    return [id(p) for p in params]


def test_is_moe_param_and_the_splits():
    net = Net()
    params = list(net.parameters())
    expert = [p for n, p in net.named_parameters() if ".deepspeed_experts." in n]
    shared = [p for n, p in net.named_parameters() if ".deepspeed_experts." not in n]
    assert [is_moe_param(p) for p in params] == [any(p is e for e in expert) for p in params]
    got_shared, got_expert = split_params_into_shared_and_expert_params(params)
    assert ids(got_shared) == ids(shared) and ids(got_expert) == ids(expert)
    for p in params:
        p.grad_dtype = None  # allow a gradient of another dtype: the split casts it to the parameter's
        p.grad = torch.full_like(p, 2.0, dtype=torch.float64)
    net.embed.bias.grad = None
    shared_grads, expert_grads = split_params_grads_into_shared_and_expert_params(params)
    assert len(shared_grads) == len(shared) - 1 and len(expert_grads) == len(expert)
    assert all(g.dtype == torch.float32 and bool((g == 2).all()) for g in shared_grads + expert_grads)


def test_has_moe_layers():
    assert has_moe_layers(Net(num_experts=2)) == (True, 2)
    assert has_moe_layers(nn.Linear(2, 2)) == (False, 0)


def test_split_for_the_optimizer_gives_deepspeeds_groups():
    net = Net(ep_sizes=(1, 2), num_experts=2)
    named = dict(net.named_parameters())
    e1 = [p for n, p in named.items() if n.startswith("layers.0.") and ".deepspeed_experts." in n]
    e2 = [p for n, p in named.items() if n.startswith("layers.1.") and ".deepspeed_experts." in n]
    dense = [p for n, p in named.items() if ".deepspeed_experts." not in n]
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(net.parameters()), "name": "main", "lr": 0.1}])
    assert [{k: v for k, v in g.items() if k != "params"} for g in groups] == [
        {"name": "main", "lr": 0.1},
        {"name": "ep_size_1", "moe": True, "lr": 0.1},
        {"name": "ep_size_2", "moe": True, "lr": 0.1},
    ]
    assert [ids(g["params"]) for g in groups] == [ids(dense), ids(e1), ids(e2)]
    assert [is_moe_param_group(g) for g in groups] == [False, True, True]


def test_max_group_size_cuts_expert_groups():
    net = Net(num_experts=2)  # each expert: weight 16 + bias 4
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(net.parameters()), "name": "g"}, max_group_size=20)
    sizes = [[p.numel() for p in g["params"]] for g in groups]
    assert sizes == [[16, 4, 8], [16, 4], [16, 4]]  # DeepSpeed 0.19.8 gives this too
    assert [g["name"] for g in groups] == ["g", "ep_size_1", "ep_size_1"]


def test_configure_moe_param_groups():
    net = Net()
    groups = configure_moe_param_groups(list(net.parameters()))
    assert [g["name"] for g in groups] == ["dense-params", "ep_size_1"]
    already = [{"params": [net.embed.weight], "moe": False}]
    assert configure_moe_param_groups(already) is already
    with pytest.raises(TypeError, match="got int"):
        configure_moe_param_groups([1])
    with pytest.raises(ValueError, match="must be a list, got tuple"):
        configure_moe_param_groups(tuple(net.parameters()))
    with pytest.raises(ValueError, match="group 0 has no 'name'"):
        split_params_into_different_moe_groups_for_optimizer([{"params": list(net.parameters())}])


def test_expert_checkpoint_names_are_empty_at_ep_rank_zero():
    assert expert_checkpoint_names(Net(num_experts=2)) == {}


def names_at_ep_2(rank, world_size):
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))  # parameters and buffers
    net = nn.ModuleDict({"dense": nn.Linear(4, 4), "moe": MoE(4, expert, num_experts=4, ep_size=2)})
    net["moe"].set_deepspeed_parallelism()
    return expert_checkpoint_names(net)


def test_expert_checkpoint_names_map_parameters_and_buffers_to_global_ids():
    from ds_comm.testing import spawn

    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    tensors = ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"]
    expected = {f"{prefix}{local}.{rest}": f"{prefix}{2 + local}.{rest}" for local in range(2) for rest in tensors}
    assert spawn(names_at_ep_2, world_size=2) == [{}, expected]
