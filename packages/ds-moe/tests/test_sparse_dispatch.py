"""The sparse dispatch (`route_slots`, `sparse_encode`, `sparse_decode`: DeepSpeed's ``_route_slots``,
``_sparse_encode``, ``_sparse_decode``) against the dense one-hot einsums of DeepSpeed's gating output, and the
`AllToAll` seam `MOELayer` sends tokens through."""

import pytest
import torch
from torch import nn

import ds_comm
from ds_comm.testing import spawn
from ds_moe import (
    AllToAll,
    MoE,
    route_slots,
    sparse_decode,
    sparse_encode,
    top1gating,
    top2gating,
    topkgating,
)


def gate(k, logits, capacity_factor, sparse_routes):
    if k == 1:
        return top1gating(logits, capacity_factor, 0, use_rts=False, sparse_routes=sparse_routes)
    if k == 2:
        return top2gating(logits, capacity_factor, 0, top2_2nd_expert_sampling=False, sparse_routes=sparse_routes)
    return topkgating(logits, k, capacity_factor, 0, sparse_routes=sparse_routes)


@pytest.mark.parametrize("capacity_factor", [1.0, 0.5])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_encode_and_decode_equal_the_dense_einsums(k, capacity_factor):
    torch.manual_seed(10 * k)
    num_tokens, num_experts, width = 16, 4, 8
    logits = torch.randn(num_tokens, num_experts)
    hidden = torch.randn(num_tokens, width, requires_grad=True)
    _, combine_weights, dispatch_mask, _ = gate(k, logits, capacity_factor, False)
    _, capacity, experts, indices, locations, gates, _ = gate(k, logits, capacity_factor, True)
    capacity = int(capacity)
    assert experts == num_experts and indices.shape == locations.shape == gates.shape == (k, num_tokens)
    if capacity_factor < 1:
        assert (indices < 0).any()  # the case really drops routes
    slots = route_slots(indices, locations, num_experts, capacity)

    encoded = sparse_encode(hidden, slots, num_experts, capacity)
    dense = torch.einsum("sec,sm->ecm", dispatch_mask.float(), hidden)
    torch.testing.assert_close(encoded, dense, rtol=0, atol=0)
    probe = torch.randn_like(dense)
    (got,) = torch.autograd.grad((encoded * probe).sum(), hidden)
    (want,) = torch.autograd.grad((dense * probe).sum(), hidden)
    torch.testing.assert_close(got, want)

    expert_output = torch.randn(num_experts, capacity, width, requires_grad=True)
    gates = gates.detach().requires_grad_()
    decoded = sparse_decode(expert_output.view(num_experts * capacity, width), slots, gates, num_tokens)
    dense = torch.einsum("sec,ecm->sm", combine_weights, expert_output)
    torch.testing.assert_close(decoded, dense)
    probe = torch.randn_like(dense)
    got, gate_grad = torch.autograd.grad((decoded * probe).sum(), [expert_output, gates])
    (want,) = torch.autograd.grad((dense * probe).sum(), expert_output)
    torch.testing.assert_close(got, want)
    # d/d gate of route r of token s: the probe against that route's expert row (0 for a dropped route)
    rows = torch.cat([expert_output.detach().view(-1, width), torch.zeros(1, width)])[slots]
    torch.testing.assert_close(gate_grad, (rows * probe.unsqueeze(0)).sum(-1))


def test_route_slots_by_hand():
    # 3 tokens, 2 experts, capacity 2; route 1 of token 0 and both of token 2 dropped (-1).
    indices = torch.tensor([[1, 0, -1], [-1, 1, -1]], dtype=torch.int32)
    locations = torch.tensor([[0, 0, 0], [0, 1, 0]], dtype=torch.int32)
    slots = route_slots(indices, locations, 2, 2)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [[2, 0, 4], [4, 3, 4]]  # 4 = E * C, the scratch row
    tokens = torch.arange(6, dtype=torch.float32).reshape(3, 2) + 1
    buffer = sparse_encode(tokens, slots, 2, 2)
    want = torch.zeros(2, 2, 2)
    want[1, 0], want[0, 0], want[1, 1] = tokens[0], tokens[1], tokens[1]
    assert torch.equal(buffer, want)
    gates = torch.tensor([[0.7, 0.6, 0.5], [0.3, 0.4, 0.5]])
    out = sparse_decode((buffer * 10).view(4, 2), slots, gates, 3)
    expected = torch.stack([0.7 * 10 * tokens[0], (0.6 + 0.4) * 10 * tokens[1], torch.zeros(2)])
    torch.testing.assert_close(out, expected)


def test_decode_accumulates_bf16_outputs_in_the_gates_fp32():
    torch.manual_seed(0)
    num_tokens, k, rows, width = 64, 3, 50, 16
    expert_output = torch.randn(rows, width).to(torch.bfloat16)
    slots = torch.randint(0, rows, (k, num_tokens))
    gates = torch.rand(k, num_tokens)
    out = sparse_decode(expert_output, slots, gates, num_tokens)
    assert out.dtype == torch.bfloat16
    routed = expert_output.float()[slots]
    want = (routed * gates.unsqueeze(-1)).sum(0).to(torch.bfloat16)
    assert torch.equal(out, want)
    in_bf16 = (expert_output[slots] * gates.to(torch.bfloat16).unsqueeze(-1)).sum(0)
    assert not torch.equal(out, in_bf16)  # the fp32 accumulation is what makes the difference


def test_bad_shapes_are_named():
    slots = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="indices must be"):
        route_slots(torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 2, 2)
    with pytest.raises(ValueError, match="locations must have the shape"):
        route_slots(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32), 2, 2)
    with pytest.raises(ValueError, match="tokens must be"):
        sparse_encode(torch.zeros(3), slots, 2, 2)
    with pytest.raises(ValueError, match="slots cover 3 tokens, tokens has 4"):
        sparse_encode(torch.zeros(4, 5), slots, 2, 2)
    with pytest.raises(ValueError, match="expert_output must be"):
        sparse_decode(torch.zeros(2, 2, 5), slots, torch.zeros(2, 3), 3)
    with pytest.raises(ValueError, match="gates must have the shape"):
        sparse_decode(torch.zeros(4, 5), slots, torch.zeros(1, 3), 3)
    with pytest.raises(ValueError, match="num_tokens is 5"):
        sparse_decode(torch.zeros(4, 5), slots, torch.zeros(2, 3), 5)


def _count_all_to_alls(rank, world_size):
    counts = {}
    original = AllToAll.apply
    for ep_size in (1, 2):
        calls = []

        def counted(group, input, calls=calls):
            calls.append(tuple(input.shape))
            return original(group, input)

        torch.manual_seed(0)
        moe = MoE(8, nn.Linear(8, 8), num_experts=2, ep_size=ep_size, k=1, min_capacity=0)
        moe.set_deepspeed_parallelism()
        x = torch.randn(1, 4, 8, requires_grad=True)
        AllToAll.apply = counted
        try:
            out, l_aux, _ = moe(x)
            forward = len(calls)
            (out.sum() + l_aux).backward()
        finally:
            del AllToAll.apply  # the inherited torch.autograd.Function.apply again
        counts[ep_size] = (forward, len(calls), x.grad is not None)
    ds_comm.barrier()
    return counts


def test_moe_layer_sends_tokens_through_all_to_all_apply():
    # The forward calls AllToAll.apply twice with ep_size 2 (out to the experts, back); the backward's two go
    # through the same Function's backward (the real one, counted here since it calls apply too).
    for counts in spawn(_count_all_to_alls, world_size=2):
        assert counts[1] == (0, 0, True)
        assert counts[2] == (2, 4, True)
