"""Expert parallelism on 2 ranks: ep_size=2 (2 experts per rank, all-to-all) equals ep_size=1 (all 4 experts on
every rank) on the same per-rank data and the same full weights."""

import torch
from torch import nn

import ds_comm
from ds_comm.testing import spawn
from ds_moe import MoE, expert_checkpoint_names

M, E = 8, 4


def build(ep_size, drop_tokens):
    torch.manual_seed(0)  # the same full weights on every rank and for both ep sizes
    expert = nn.Sequential(nn.Linear(M, 16), nn.GELU(), nn.Linear(16, M))
    full = MoE(M, expert, num_experts=E, k=2, capacity_factor=0.75, min_capacity=1, drop_tokens=drop_tokens)
    if ep_size == 1:
        return full
    moe = MoE(M, expert, num_experts=E, ep_size=ep_size, k=2, capacity_factor=0.75, min_capacity=1,
              drop_tokens=drop_tokens)
    rank = ds_comm.get_rank()
    local = E // ep_size
    moe.deepspeed_moe.gate.load_state_dict(full.deepspeed_moe.gate.state_dict())
    for i in range(local):
        moe.deepspeed_moe.experts.deepspeed_experts[i].load_state_dict(
            full.deepspeed_moe.experts.deepspeed_experts[rank * local + i].state_dict())
    return moe


def run(ep_size, drop_tokens, rank):
    moe = build(ep_size, drop_tokens)
    moe.set_deepspeed_parallelism()
    seen = []
    route = moe.deepspeed_moe.gate.route
    moe.deepspeed_moe.gate.route = lambda *a: seen.append(route(*a)) or seen[-1]
    torch.manual_seed(100 + rank)  # per-rank data
    x = torch.randn(2, 6, M, requires_grad=True)
    probe = torch.randn(2, 6, M)
    ds_comm.comms_logger.reset()
    torch.manual_seed(7)  # the same gating noise (second-expert sampling) for both ep sizes
    out, l_aux, exp_counts = moe(x)
    ((out * probe).sum() + l_aux).backward()
    ops = [(r.op, r.count) for r in ds_comm.comms_logger.records() if r.op == "all_to_all_single"]
    local = E // ep_size
    ep_rank = rank if ep_size > 1 else 0
    grads = {}
    for i, one in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
        for name, p in one.named_parameters():
            grads[(ep_rank * local + i, name)] = p.grad
    if ep_size == 1:  # every rank computed every expert on its own tokens: the ep=2 gradient is the sum
        for g in grads.values():
            ds_comm.all_reduce(g)
    else:  # gather the other rank's experts by global id
        gathered = {}
        for (gid, name), g in sorted(grads.items()):
            parts = [torch.empty_like(g) for _ in range(ep_size)]
            ds_comm.all_gather(parts, g.contiguous())
            for r, part in enumerate(parts):
                gathered[(r * local + gid % local, name)] = part
        grads = gathered
    return dict(out=out.detach(), l_aux=l_aux.detach(), exp_counts=exp_counts, kept=seen[0].kept,
                x_grad=x.grad, gate_grad=moe.deepspeed_moe.gate.wg.weight.grad, expert_grads=grads, a2a=ops,
                names=expert_checkpoint_names(moe))


def compare(rank, world_size, drop_tokens):
    ds_comm.configure(enabled=True)
    one = run(1, drop_tokens, rank)
    two = run(2, drop_tokens, rank)
    ds_comm.configure(enabled=False)
    checks = {}
    for key in ("out", "l_aux", "x_grad", "gate_grad"):
        checks[key] = (one[key] - two[key]).abs().max().item()
    checks["exp_counts"] = torch.equal(one["exp_counts"], two["exp_counts"])
    checks["kept"] = torch.equal(one["kept"], two["kept"])
    checks["dropped"] = int((~two["kept"]).sum())
    assert sorted(one["expert_grads"]) == sorted(two["expert_grads"])
    checks["expert_grads"] = max((one["expert_grads"][k] - two["expert_grads"][k]).abs().max().item()
                                 for k in one["expert_grads"])
    checks["a2a"] = (one["a2a"], two["a2a"])
    checks["names"] = (one["names"], two["names"])
    return checks


def check_bad_world(rank, world_size):
    torch.manual_seed(0)
    moe = MoE(M, nn.Linear(M, M), num_experts=3, ep_size=3)
    try:
        moe(torch.randn(4, M))
    except ValueError as err:
        return str(err)
    return None


def _expected_names(rank):
    if rank == 0:
        return {}
    prefix = "deepspeed_moe.experts.deepspeed_experts."
    return {f"{prefix}{i}.{layer}.{kind}": f"{prefix}{i + 2}.{layer}.{kind}"
            for i in range(2) for layer in (0, 2) for kind in ("weight", "bias")}


def test_ep2_equals_ep1_with_token_dropping_and_dropless():
    for drop_tokens in (True, False):
        results = spawn(compare, world_size=2, args=(drop_tokens,))
        for rank, checks in enumerate(results):
            for key in ("out", "l_aux", "x_grad", "gate_grad", "expert_grads"):
                assert checks[key] <= 1e-6, (drop_tokens, rank, key, checks[key])
            assert checks["exp_counts"] and checks["kept"], (drop_tokens, rank)
            assert (checks["dropped"] > 0) is drop_tokens  # capacity 0.75 really drops
            # ep=1: no all-to-all; ep=2: two in the forward, two (their inverses) in the backward.
            assert checks["a2a"][0] == []
            assert sum(count for _, count in checks["a2a"][1]) == 4, checks["a2a"]
            assert checks["names"] == ({}, _expected_names(rank))


def test_ep_size_not_dividing_the_world_is_named():
    for message in spawn(check_bad_world, world_size=2):
        assert message is not None and "ep_size=3" in message and "world size 2" in message
