"""MoE / MOELayer / Experts on one process, against plain per-token references written here."""

import pytest
import torch
from torch import nn

import ds_comm
from ds_moe import Experts, MoE
from ds_moe._dispatch import combine, dispatch
from ds_moe._gating import Routing

M = 8


def mlp(hidden=M, inner=16):
    return nn.Sequential(nn.Linear(hidden, inner), nn.GELU(), nn.Linear(inner, hidden))


def make(num_experts=4, k=2, seed=0, **kwargs):
    torch.manual_seed(seed)
    return MoE(M, mlp(), num_experts=num_experts, k=k, **kwargs)


def reference(moe, x, seed):
    """Route with the gate (same RNG draw as the layer's), then for each token the sum over its kept choices
    of weight * expert(token), one token and one expert at a time."""
    torch.manual_seed(seed)
    flat = x.reshape(-1, M)
    routing = moe.deepspeed_moe.gate.route(flat)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    rows = []
    for s in range(flat.shape[0]):
        acc = torch.zeros(M)
        for j in range(routing.expert.shape[1]):
            if routing.kept[s, j]:
                acc = acc + routing.weight[s, j] * experts[int(routing.expert[s, j])](flat[s:s + 1])[0]
        rows.append(acc)
    return torch.stack(rows).reshape(x.shape), routing


@pytest.mark.parametrize("k,capacity_factor,drop_tokens", [(1, 1.0, True), (2, 0.5, True), (2, 1.0, False),
                                                            (3, 0.75, True)])
def test_moe_output_and_gradients_equal_a_per_token_reference(k, capacity_factor, drop_tokens):
    moe = make(k=k, capacity_factor=capacity_factor, min_capacity=1, drop_tokens=drop_tokens)
    x = torch.randn(3, 6, M, requires_grad=True)
    ref, routing = reference(moe, x, seed=5)
    torch.manual_seed(5)
    out, l_aux, exp_counts = moe(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(l_aux, routing.l_aux)
    assert torch.equal(exp_counts, routing.exp_counts)
    if drop_tokens and capacity_factor < 1:
        assert not routing.kept.all()  # the case really drops
    probe = torch.randn_like(out)
    params = [x, *moe.parameters()]
    got = torch.autograd.grad((out * probe).sum(), params)
    want = torch.autograd.grad((ref * probe).sum(), params, allow_unused=True)
    for p, g, w in zip(params, got, want, strict=True):
        torch.testing.assert_close(g, torch.zeros_like(p) if w is None else w, rtol=0, atol=1e-6)


def test_a_token_with_every_choice_dropped_outputs_zero():
    moe = make(k=1, capacity_factor=0.25, min_capacity=1)
    x = torch.randn(16, M)
    torch.manual_seed(1)
    routing = moe.deepspeed_moe.gate.route(x)
    torch.manual_seed(1)
    out, _, _ = moe(x)
    dropped = ~routing.kept.any(dim=1)
    assert dropped.any()
    assert torch.equal(out[dropped], torch.zeros_like(out[dropped]))
    assert (out[~dropped].abs().sum(dim=1) > 0).all()


def test_dispatch_and_combine_on_a_hand_built_routing():
    # 3 tokens, 2 experts, capacity 2: token 0 -> (e1 slot 0, e0 slot 1 dropped), token 1 -> (e0 slot 0,
    # e1 slot 1), token 2 -> (e1 dropped, e0 dropped).
    tokens = torch.arange(3 * 2, dtype=torch.float32).reshape(3, 2) + 1
    routing = Routing(expert=torch.tensor([[1, 0], [0, 1], [1, 0]]), slot=torch.tensor([[0, 1], [0, 1], [2, 2]]),
                      weight=torch.tensor([[0.7, 0.0], [0.6, 0.4], [0.0, 0.0]]),
                      kept=torch.tensor([[True, False], [True, True], [False, False]]), capacity=2,
                      l_aux=torch.tensor(0.0), exp_counts=torch.tensor([2, 2]))
    buffer = dispatch(tokens, routing, 2)
    want = torch.zeros(2, 2, 2)
    want[1, 0], want[0, 0], want[1, 1] = tokens[0], tokens[1], tokens[1]
    assert torch.equal(buffer, want)
    out = combine(buffer * 10, routing, 3)
    expected = torch.stack([0.7 * 10 * tokens[0], (0.6 + 0.4) * 10 * tokens[1], torch.zeros(2)])
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("shape", [(12, M), (3, 4, M), (2, 3, 2, M)])
def test_any_leading_dims(shape):
    moe = make(k=2)
    x = torch.randn(*shape)
    torch.manual_seed(3)
    out, _, counts = moe(x)
    torch.manual_seed(3)
    flat, _, flat_counts = moe(x.reshape(-1, M))
    assert out.shape == x.shape
    torch.testing.assert_close(out.reshape(-1, M), flat, rtol=0, atol=0)
    assert torch.equal(counts, flat_counts)


def test_pr_moe_mixes_the_dense_mlp_by_the_learned_coefficient():
    torch.manual_seed(0)
    dense = mlp()
    moe = MoE(M, dense, num_experts=2, k=1, use_residual=True)
    assert moe.mlp is dense and isinstance(moe.coefficient, nn.Linear)
    assert moe.coefficient.in_features == M and moe.coefficient.out_features == 2
    assert not any(hasattr(p, "allreduce") for p in dense.parameters())
    x = torch.randn(2, 5, M)
    torch.manual_seed(4)
    experts_out = moe.deepspeed_moe(x)
    torch.manual_seed(4)
    out, _, _ = moe(x)
    coef = torch.softmax(x @ moe.coefficient.weight.T + moe.coefficient.bias, dim=-1)
    want = experts_out * coef[..., :1] + dense(x) * coef[..., 1:]
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)


class Tanh2(nn.Module):
    """An expert returning (output, bias), as Megatron's MLPs do: the bias is ignored (DeepSpeed's rule)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(M, M)

    def forward(self, x):
        return torch.tanh(self.fc(x)), self.fc.bias


class Branchy(nn.Module):
    """Data-dependent control flow: vmap cannot run it, so Experts falls back to its loop."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(M, M)

    def forward(self, x):
        return self.fc(x) if x.sum() > -1e9 else -self.fc(x)


@pytest.mark.parametrize("expert", [mlp, Tanh2, Branchy, lambda: nn.Sequential(nn.Linear(M, M), nn.BatchNorm1d(M))])
def test_batched_experts_equal_a_per_expert_loop(expert):
    torch.manual_seed(0)
    experts = Experts(expert(), num_local_experts=3, expert_group_name="ep_size_1")
    has_buffers = expert is not mlp and expert is not Tanh2 and expert is not Branchy
    assert experts.batched is (False if has_buffers else None)  # None: batched on accelerators, a loop on CPU
    if not has_buffers:
        experts.batched = True  # the batched path, on this CPU too
    for i, one in enumerate(experts.deepspeed_experts):  # make the copies differ
        for p in one.parameters():
            p.data.add_(0.1 * (i + 1))
    x = torch.randn(3, 5, M, requires_grad=True)
    out = experts(x)
    looped = torch.stack([e(x[i]) if not isinstance(e(x[i]), tuple) else e(x[i])[0]
                          for i, e in enumerate(experts.deepspeed_experts)])
    torch.testing.assert_close(out, looped, rtol=0, atol=1e-6)
    probe = torch.randn_like(out)
    params = [x, *experts.parameters()]
    got = torch.autograd.grad((out * probe).sum(), params, allow_unused=True)
    want = torch.autograd.grad((looped * probe).sum(), params, allow_unused=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    assert experts._vmap_failed is (expert is Branchy)


def test_batched_path_is_one_vmapped_call_and_the_loop_can_be_forced():
    torch.manual_seed(0)
    experts = Experts(nn.Linear(M, 4), num_local_experts=2)
    x = torch.randn(2, 3, M)
    calls = []
    handle = experts.deepspeed_experts[1].register_forward_pre_hook(lambda m, a: calls.append(1))
    experts(x)
    assert calls == [1]  # the default on a CPU tensor: one expert at a time
    calls.clear()
    experts.batched = True
    batched = experts(x)
    assert calls == []  # the batched path runs the template (expert 0) once under vmap, never expert 1
    experts.batched = False
    looped = experts(x)
    assert calls == [1]
    handle.remove()
    torch.testing.assert_close(batched, looped, rtol=0, atol=1e-6)
    # DeepSpeed's [G, E_local, C, M] layout gives the same per-expert results.
    four = experts(x.reshape(2, 1, 3, M).transpose(0, 1))
    torch.testing.assert_close(four.transpose(0, 1).reshape(2, 3, 4), looped, rtol=0, atol=1e-6)


def test_expert_parameters_are_marked_and_named_as_deepspeed():
    moe = make(num_experts=4, ep_size=2)
    names = [n for n, _ in moe.named_parameters()]
    assert names[0] == "deepspeed_moe.gate.wg.weight"
    assert "deepspeed_moe.experts.deepspeed_experts.1.2.bias" in names
    assert not any("deepspeed_experts.2." in n for n in names)  # 2 local experts
    assert moe.num_local_experts == 2 and moe.expert_group_name == "ep_size_2"
    for name, p in moe.named_parameters():
        is_expert = ".deepspeed_experts." in name
        assert (getattr(p, "allreduce", True) is False) is is_expert
        if is_expert:
            assert p.group_name == "ep_size_2"
    assert moe.deepspeed_moe.gate.wg.weight.dtype == torch.float32


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(num_experts=3, ep_size=2), ValueError, ["num_experts (3)", "ep_size (2)"]),
    (dict(num_experts=2, k=3), ValueError, ["k (3)", "num_experts (2)"]),
    (dict(capacity_factor=0.0), ValueError, ["capacity_factor", "0.0"]),
    (dict(eval_capacity_factor=-1.0), ValueError, ["eval_capacity_factor", "-1.0"]),
    (dict(min_capacity=-1), ValueError, ["min_capacity", "-1"]),
    (dict(num_experts=0), ValueError, ["num_experts", "0"]),
    (dict(noisy_gate_policy="Gauss"), ValueError, ["noisy_gate_policy", "Gauss"]),
    (dict(use_tutel=True), NotImplementedError, ["Tutel"]),
    (dict(enable_expert_tensor_parallelism=True), NotImplementedError, ["expert tensor parallelism"]),
    (dict(expert=lambda x: x), ValueError, ["nn.Module", "function"]),
])
def test_bad_input_is_named(kwargs, error, words):
    args = dict(hidden_size=M, expert=mlp(), num_experts=4)
    args.update(kwargs)
    with pytest.raises(error) as info:
        MoE(**args)
    for word in words:
        assert word in str(info.value)


def test_experts_refuse_a_non_module():
    with pytest.raises(ValueError, match=r"nn\.Module, got int"):
        Experts(3)


def test_expert_parallel_without_a_process_group_is_refused_by_name():
    assert not ds_comm.is_initialized()
    moe = make(num_experts=4, ep_size=2)
    with pytest.raises(RuntimeError, match="ep_size=2 needs a process group"):
        moe(torch.randn(4, M))
    with pytest.raises(RuntimeError, match="no process group"):
        moe.set_deepspeed_parallelism()


def test_wall_clock_breakdown_records_deepspeed_timers():
    moe = make()
    moe.deepspeed_moe.wall_clock_breakdown = True
    moe(torch.randn(6, M))
    assert set(moe.deepspeed_moe.timings) == {"topk_gate", "1st_a2a", "2nd_a2a", "moe"}
    assert moe.deepspeed_moe.time_moe > 0
    assert moe.deepspeed_moe.time_moe >= moe.deepspeed_moe.time_falltoall


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_moe_on_cuda_equals_the_cpu():
    moe = make(k=2, eval_capacity_factor=0.75, min_capacity=1).eval()  # eval: k=2 routing draws no noise
    x = torch.randn(4, 6, M)
    out, l_aux, counts = moe(x)
    gpu = moe.to("cuda")
    out_gpu, l_aux_gpu, counts_gpu = gpu(x.to("cuda"))
    assert out_gpu.device.type == "cuda" and counts_gpu.device.type == "cuda"
    torch.testing.assert_close(out_gpu.cpu(), out, rtol=0, atol=1e-5)
    torch.testing.assert_close(l_aux_gpu.cpu(), l_aux, rtol=0, atol=1e-6)
    assert torch.equal(counts_gpu.cpu(), counts)
