"""TopKGate and the gating functions against plain per-token references written here."""

import logging
import math

import pytest
import torch
import torch.nn.functional as F

import ds_comm
from ds_comm.testing import spawn
from ds_moe._gating import (
    Routing,
    TopKGate,
    gumbel_rsample,
    multiplicative_jitter,
    top1gating,
    top2gating,
    topkgating,
)


# ----------------------------------------------------------------------------------------------- references
def ref_capacity(S, E, cf, mc):
    return max(math.ceil(S / E * cf), mc)


def ref_slots(kept_pairs):
    """kept (token, expert) pairs in buffer order -> {(token, expert): slot}."""
    nxt, slots = {}, {}
    for s, e in kept_pairs:
        slots[(s, e)] = nxt.get(e, 0)
        nxt[e] = slots[(s, e)] + 1
    return slots


def ref_top1(logits, cap, used=None, priority=None):
    """Switch gating, token by token: per expert the `cap` tokens of highest priority survive (no priority:
    the first ones); slots in token order among the survivors. Returns dict."""
    S, E = logits.shape
    gates = torch.softmax(logits.double(), dim=1)
    used = [True] * S if used is None else [bool(u) for u in used]
    expert = [int(torch.argmax(logits[s])) for s in range(S)]
    counts = [0] * E
    for s in range(S):
        if used[s]:
            counts[expert[s]] += 1
    kept = set()
    for e in range(E):
        toks = [s for s in range(S) if used[s] and expert[s] == e]
        if priority is not None:
            toks = sorted(toks, key=lambda s: -float(priority[s, e]))
        kept.update(toks[:cap])
    slots = ref_slots([(s, expert[s]) for s in range(S) if s in kept])
    combine = torch.zeros(S, E, cap, dtype=torch.float64)
    for (s, e), c in slots.items():
        combine[s, e, c] = gates[s, e]
    l_aux = sum(float(gates[:, e].mean()) * counts[e] / S for e in range(E)) * E
    return dict(expert=expert, kept=kept, combine=combine, counts=counts, l_aux=l_aux)


def ref_top2(logits, cap):
    """GShard top-2 without sampling, token by token."""
    S, E = logits.shape
    gates = torch.softmax(logits.double(), dim=1)
    first = [int(torch.argmax(gates[s])) for s in range(S)]
    second = []
    for s in range(S):
        order = sorted(range(E), key=lambda e: -float(gates[s, e]))
        second.append(next(e for e in order if e != first[s]))
    count1 = [first.count(e) for e in range(E)]
    loc, n1, n2 = {}, [0] * E, [0] * E
    for s in range(S):
        loc[(s, 0)] = n1[first[s]]
        n1[first[s]] += 1
    for s in range(S):
        loc[(s, 1)] = count1[second[s]] + n2[second[s]]
        n2[second[s]] += 1
    combine = torch.zeros(S, E, cap, dtype=torch.float64)
    for s in range(S):
        g = [float(gates[s, first[s]]) if loc[(s, 0)] < cap else 0.0,
             float(gates[s, second[s]]) if loc[(s, 1)] < cap else 0.0]
        denom = max(g[0] + g[1], torch.finfo(torch.float32).eps)
        for j, e in enumerate((first[s], second[s])):
            if loc[(s, j)] < cap:
                combine[s, e, loc[(s, j)]] = g[j] / denom
    counts = [count1[e] + second.count(e) for e in range(E)]
    l_aux = sum(float(gates[:, e].mean()) * count1[e] / S for e in range(E)) * E
    return dict(first=first, second=second, combine=combine, counts=counts, l_aux=l_aux)


def ref_topk(logits, k, cap):
    """Top-k with DeepSpeed's 'probs' drop policy: per expert the `cap` most probable routes survive."""
    S, E = logits.shape
    gates = torch.softmax(logits.double(), dim=1)
    chosen = [sorted(range(E), key=lambda e: -float(gates[s, e]))[:k] for s in range(S)]
    counts = [sum(e in chosen[s] for s in range(S)) for e in range(E)]
    kept = set()
    for e in range(E):
        toks = sorted((s for s in range(S) if e in chosen[s]), key=lambda s: -float(gates[s, e]))
        kept.update((s, e) for s in toks[:cap])
    slots = ref_slots([(s, e) for s in range(S) for e in range(E) if (s, e) in kept])
    combine = torch.zeros(S, E, cap, dtype=torch.float64)
    for s in range(S):
        denom = max(sum(float(gates[s, e]) for e in chosen[s] if (s, e) in kept), torch.finfo(torch.float32).eps)
        for e in chosen[s]:
            if (s, e) in kept:
                combine[s, e, slots[(s, e)]] = float(gates[s, e]) / denom
    l_aux = sum(float(gates[:, e].mean()) * counts[e] / S for e in range(E)) * E / k
    return dict(chosen=chosen, combine=combine, counts=counts, l_aux=l_aux)


def make_gate(d, E, seed=0, **kw):
    torch.manual_seed(seed)
    return TopKGate(d, E, **kw)


def logits_of(gate, x):
    return x.float() @ gate.wg.weight.float().t()


def check_dense_matches_routing(combine, dispatch, r: Routing):
    S, k = r.expert.shape
    expect = torch.zeros_like(combine)
    for s in range(S):
        for j in range(k):
            if r.kept[s, j]:
                expect[s, r.expert[s, j], r.slot[s, j]] += r.weight[s, j]
            else:
                assert r.weight[s, j] == 0
    assert torch.equal(combine, expect)
    assert torch.equal(dispatch, expect != 0)


# ----------------------------------------------------------------------------------------------- capacity
@pytest.mark.parametrize("S,E,cf,mc", [(16, 4, 1.0, 0), (16, 4, 1.0, 8), (33, 5, 0.5, 1), (64, 8, 1.25, 4),
                                       (10, 3, 2.0, 0), (40, 16, 0.5, 2)])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_capacity(S, E, cf, mc, k):
    gate = make_gate(6, E, k=k, capacity_factor=cf, eval_capacity_factor=cf, min_capacity=mc)
    r = gate.route(torch.randn(S, 6))
    assert r.capacity == ref_capacity(S, E, cf * k, mc)
    assert isinstance(r.capacity, int)


def test_capacity_rounds_in_fp32_as_deepspeed():
    # DeepSpeed multiplies by a float32 capacity factor: ceil(100 * float32(1.1)) = 110 (float64 gives 111)
    gate = make_gate(4, 1, capacity_factor=1.1, min_capacity=0)
    assert gate.route(torch.randn(100, 4)).capacity == 110


# ----------------------------------------------------------------------------------------------- top-1
def test_top1_first_come_without_rts():
    S, E = 24, 4
    torch.manual_seed(1)
    logits = torch.randn(S, E) * 2
    logits[:, 0] += 2.0  # overload expert 0 so tokens are dropped
    l_aux, combine, dispatch, counts = top1gating(logits, 0.5, 0, use_rts=False)
    cap = ref_capacity(S, E, 0.5, 0)
    ref = ref_top1(logits, cap)
    assert combine.shape == (S, E, cap)
    torch.testing.assert_close(combine.double(), ref["combine"])
    assert torch.equal(dispatch, ref["combine"] != 0)
    assert counts.tolist() == ref["counts"] and counts.dtype == torch.int64  # counted before dropping
    assert counts.max() > cap and int(dispatch.sum()) < S
    torch.testing.assert_close(l_aux.double(), torch.tensor(ref["l_aux"], dtype=torch.float64))
    # the first tokens of each expert are the ones kept
    first0 = [s for s in range(S) if ref["expert"][s] == 0][:cap]
    assert sorted(dispatch[:, 0].any(1).nonzero().flatten().tolist()) == first0


def test_top1_random_token_selection():
    S, E = 32, 4
    torch.manual_seed(2)
    logits = torch.randn(S, E)
    logits[:, 1] += 3.0
    cap = ref_capacity(S, E, 1.0, 0)
    torch.manual_seed(7)
    _, combine, dispatch, counts = top1gating(logits, 1.0, 0, use_rts=True)
    torch.manual_seed(7)
    priority = torch.rand(S, E)  # DeepSpeed's stream: one uniform per (token, expert) after the logits
    ref = ref_top1(logits, cap, priority=priority)
    torch.testing.assert_close(combine.double(), ref["combine"])
    assert counts.tolist() == ref["counts"]
    kept1 = dispatch[:, 1].any(1).nonzero().flatten().tolist()
    first = [s for s in range(S) if ref["expert"][s] == 1][:cap]
    assert len(kept1) == cap and kept1 != first  # a random subset, not the first ones
    # another seed keeps another subset
    torch.manual_seed(8)
    other = top1gating(logits, 1.0, 0, use_rts=True)[2][:, 1].any(1).nonzero().flatten().tolist()
    assert other != kept1 and len(other) == cap


def test_top1_used_token():
    S, E = 18, 3
    torch.manual_seed(3)
    logits = torch.randn(S, E)
    used = (torch.arange(S) % 3 != 0).long()
    gate_out = top1gating(logits, 1.0, 0, used_token=used, use_rts=False)
    ref = ref_top1(logits, ref_capacity(S, E, 1.0, 0), used=used)
    torch.testing.assert_close(gate_out[1].double(), ref["combine"])
    assert not gate_out[2][used == 0].any()
    assert gate_out[3].tolist() == ref["counts"] and int(gate_out[3].sum()) == int(used.sum())
    torch.testing.assert_close(gate_out[0].double(), torch.tensor(ref["l_aux"], dtype=torch.float64))
    gate = make_gate(5, E, use_rts=False, min_capacity=0)
    r = gate.route(torch.randn(S, 5), used_token=used.bool())
    assert not r.kept[used == 0].any() and (r.weight[used == 0] == 0).all()


def test_top1_needs_min_capacity_tokens():
    with pytest.raises(ValueError, match="min_capacity=8"):
        top1gating(torch.randn(5, 2), 1.0, 8)


# ----------------------------------------------------------------------------------------------- top-2 / top-k
def test_top2_without_sampling():
    S, E = 20, 4
    torch.manual_seed(4)
    logits = torch.randn(S, E) * 2
    logits[:, 2] += 1.5
    for cf in (0.5, 1.0):
        cap = ref_capacity(S, E, 2 * cf, 0)
        l_aux, combine, dispatch, counts = top2gating(logits.clone(), cf, 0, top2_2nd_expert_sampling=False)
        ref = ref_top2(logits, cap)
        torch.testing.assert_close(combine.double(), ref["combine"])
        assert torch.equal(dispatch, ref["combine"] != 0)
        assert counts.tolist() == ref["counts"]
        torch.testing.assert_close(l_aux.double(), torch.tensor(ref["l_aux"], dtype=torch.float64))
    assert int(top2gating(logits.clone(), 0.5, 0, top2_2nd_expert_sampling=False)[2].sum()) < 2 * S


def test_top2_second_expert_sampling():
    S, E, d = 256, 8, 6
    gate = make_gate(d, E, k=2, min_capacity=0, drop_tokens=False)
    x = torch.randn(S, d)
    greedy = torch.topk(logits_of(gate, x), 2, dim=1).indices
    gate.train()
    r = gate.route(x)
    assert torch.equal(r.expert[:, 0], greedy[:, 0])
    assert (r.expert[:, 1] != r.expert[:, 0]).all()
    assert (r.expert[:, 1] != greedy[:, 1]).any()
    gate.eval()  # no sampling in eval
    assert torch.equal(gate.route(x).expert, greedy)
    gate.top2_2nd_expert_sampling = False
    gate.train()
    assert torch.equal(gate.route(x).expert, greedy)


def test_topk_k3():
    S, E, k = 30, 6, 3
    torch.manual_seed(5)
    logits = torch.randn(S, E) * 2
    logits[:, 0] += 2.0
    for cf in (0.5, 2.0):
        cap = ref_capacity(S, E, cf * k, 1)
        l_aux, combine, dispatch, counts = topkgating(logits, k, cf, 1)
        ref = ref_topk(logits, k, cap)
        torch.testing.assert_close(combine.double(), ref["combine"])
        assert torch.equal(dispatch, ref["combine"] != 0)
        assert counts.tolist() == ref["counts"]
        torch.testing.assert_close(l_aux.double(), torch.tensor(ref["l_aux"], dtype=torch.float64))
    assert int(topkgating(logits, k, 0.5, 1)[2].sum()) < S * k
    # dropless: nothing dropped, capacity = the largest load
    _, combine, dispatch, counts = topkgating(logits, k, 0.5, 1, drop_tokens=False)
    assert combine.shape[2] == int(counts.max()) and int(dispatch.sum()) == S * k
    torch.testing.assert_close(combine.sum((1, 2)), torch.ones(S))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dense_forward_equals_routing(k):
    gate = make_gate(6, 5, k=k, min_capacity=0, capacity_factor=0.75)
    x = torch.randn(26, 6)
    gate.eval()
    torch.manual_seed(3)  # the same random token selection stream for both calls
    r = gate.route(x)
    torch.manual_seed(3)
    l_aux, combine, dispatch, counts = gate(x)
    assert combine.shape == (26, 5, r.capacity)
    check_dense_matches_routing(combine, dispatch, r)
    assert torch.equal(counts, r.exp_counts) and torch.equal(l_aux, r.l_aux)
    # DeepSpeed 0.19.8's sparse_routes tuple from the same routing
    torch.manual_seed(3)
    l2, cap, E, idx, loc, g, counts2 = gate(x, None, True)
    assert torch.equal(l2, r.l_aux) and torch.equal(counts2, r.exp_counts)
    assert int(cap) == r.capacity and E == 5 and idx.shape == (k, 26) and idx.dtype == torch.int32
    assert torch.equal(idx.t().long(), torch.where(r.kept, r.expert, -1))
    assert torch.equal(loc.t().long(), r.slot * r.kept) and torch.equal(g.t(), r.weight)


def test_dropless_single_rank():
    S, E = 16, 4
    torch.manual_seed(6)
    logits = torch.randn(S, E)
    logits[:, 3] += 2
    _, combine, dispatch, counts = top1gating(logits, 0.25, 0, drop_tokens=False)
    assert combine.shape[2] == int(counts.max()) and int(dispatch.sum()) == S
    _, combine, dispatch, counts = top2gating(logits.clone(), 0.25, 0, drop_tokens=False)
    assert combine.shape[2] == int(counts.max()) and int(dispatch.sum()) == 2 * S


# ----------------------------------------------------------------------------------------------- modes and noise
def test_eval_capacity_factor():
    gate = make_gate(4, 4, capacity_factor=1.0, eval_capacity_factor=2.0, min_capacity=0)
    x = torch.randn(32, 4)
    gate.train()
    assert gate.route(x).capacity == 8
    gate.eval()
    assert gate.route(x).capacity == 16


def test_jitter_only_in_training():
    gate = make_gate(6, 4, noisy_gate_policy="Jitter", min_capacity=0, drop_tokens=False, use_rts=False)
    x = torch.randn(64, 6)
    clean = F.softmax(logits_of(gate, x), dim=1)
    gate.eval()
    r = gate.route(x)
    assert torch.equal(r.expert[:, 0], clean.argmax(1))
    torch.testing.assert_close(r.weight[:, 0], clean.gather(1, r.expert).squeeze(1))
    gate.train()
    r = gate.route(x)
    assert not torch.allclose(r.weight[:, 0], clean.gather(1, r.expert).squeeze(1), rtol=0, atol=1e-7)
    torch.manual_seed(0)
    y = multiplicative_jitter(x, device=x.device)
    assert ((y / x - 1).abs() <= 1e-2 + 1e-6).all() and not torch.equal(x, y)


def test_rsample_only_in_training():
    gate = make_gate(6, 4, noisy_gate_policy="RSample", min_capacity=0, drop_tokens=False)
    x = torch.randn(64, 6)
    clean = F.softmax(logits_of(gate, x), dim=1)
    gate.eval()
    assert torch.equal(gate.route(x).expert[:, 0], clean.argmax(1))
    gate.train()
    r = gate.route(x)
    assert (r.expert[:, 0] != clean.argmax(1)).any()
    # the weights stay the clean probabilities of the chosen expert
    torch.testing.assert_close(r.weight[:, 0], clean.gather(1, r.expert).squeeze(1))
    g = gumbel_rsample((4000,), device="cpu")
    assert abs(float(g.mean()) - 0.5772) < 0.08  # Euler-Mascheroni: the Gumbel(0, 1) mean


def test_rsample_with_k2_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="ds_moe._gating"):
        TopKGate(4, 4, k=2, noisy_gate_policy="RSample")
    assert "RSample" in caplog.text


# ----------------------------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("k", [1, 2])
def test_gradients_reach_wg(k):
    gate = make_gate(5, 4, k=k, min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False)
    x = torch.randn(20, 5)
    gate.eval()
    torch.manual_seed(9)
    target = torch.randn(20, 4, gate.route(x).capacity)
    _, combine, _, _ = gate(x)
    (combine * target).sum().backward()
    # reference: the same selection, probabilities recomputed from a copy of the weight
    w = gate.wg.weight.detach().clone().requires_grad_(True)
    probs = F.softmax(x @ w.t(), dim=1)
    with torch.no_grad():
        r = gate.route(x)
    loss = 0
    for s in range(20):
        chosen = [probs[s, r.expert[s, j]] * r.kept[s, j] for j in range(k)]
        denom = chosen[0] if k == 1 else chosen[0] + chosen[1]
        for j in range(k):
            if r.kept[s, j]:
                wgt = chosen[j] if k == 1 else chosen[j] / denom
                loss = loss + wgt * target[s, r.expert[s, j], r.slot[s, j]]
    loss.backward()
    torch.testing.assert_close(gate.wg.weight.grad, w.grad)
    assert gate.wg.weight.dtype == torch.float32


def test_l_aux_has_grad():
    gate = make_gate(5, 4, min_capacity=0)
    gate.route(torch.randn(20, 5)).l_aux.backward()
    assert gate.wg.weight.grad is not None and gate.wg.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------- aux-loss-free bias
def skewed(S, d, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, d, generator=g)
    x[:, 0] += 2.0
    return x


def make_skewed_gate(k=1, speed=0.02):
    gate = make_gate(6, 4, k=k, min_capacity=0, drop_tokens=False, bias_update_speed=speed,
                     top2_2nd_expert_sampling=False)
    with torch.no_grad():
        gate.wg.weight.mul_(0.1)
        gate.wg.weight[0, 0] = 1.0  # expert 0 takes most tokens
    return gate


@pytest.mark.parametrize("k", [1, 2])
def test_bias_balancing(k):
    gate = make_skewed_gate(k)
    gate.train()
    loads = []
    for step in range(60):
        x = skewed(64, 6, step)
        r = gate.route(x)
        loads.append(r.exp_counts.clone())
        assert r.l_aux.shape == () and float(r.l_aux) == 0.0
    first, last = loads[0].float(), torch.stack(loads[-10:]).float().mean(0)
    assert float(first.max() - first.min()) > 2 * float(last.max() - last.min())
    assert gate.expert_bias[0] < 0 and gate.expert_bias.dtype == torch.float32
    assert "expert_bias" in gate.state_dict()
    # the weights come from the unbiased probabilities; the choice from the biased scores
    x = skewed(64, 6, 1000)
    gate.eval()
    bias = gate.expert_bias.clone()
    r = gate.route(x)
    probs = F.softmax(logits_of(gate, x), dim=1)
    assert torch.equal(r.expert, torch.topk(probs + bias, k, dim=1).indices)
    chosen = probs.gather(1, r.expert)
    torch.testing.assert_close(r.weight, chosen if k == 1 else chosen / chosen.sum(1, keepdim=True))
    assert torch.equal(gate.expert_bias, bias)  # no update in eval


def test_bias_step_arithmetic():
    gate = make_skewed_gate(k=1, speed=0.5)
    gate.train()
    r = gate.route(skewed(40, 6, 0))
    load = r.exp_counts.float()
    torch.testing.assert_close(gate.expert_bias, 0.5 * torch.sign(load.mean() - load))


def test_no_bias_by_default():
    gate = TopKGate(4, 3)
    assert gate.expert_bias is None and "expert_bias" not in gate.state_dict()
    assert gate.route(torch.randn(12, 4)).l_aux > 0


# ----------------------------------------------------------------------------------------------- two ranks
def _two_rank_checks(rank, world_size):
    group = ds_comm.new_group(ranks=[0, 1])
    S, E = 12, 4
    logits = torch.zeros(S, E)
    hot = 7 if rank == 0 else 4  # rank 0's largest load is 7, rank 1's is 4
    logits[:hot, 2] = 5.0
    logits[hot:, :] = torch.eye(E)[torch.tensor([0, 1, 3])[torch.arange(S - hot) % 3]] * 5.0
    _, combine, dispatch, counts = top1gating(logits, 1.0, 0, drop_tokens=False, ep_group=group)
    top2 = top2gating(logits.clone(), 1.0, 0, drop_tokens=False, ep_group=group, top2_2nd_expert_sampling=False)
    # aux-free bias stays identical on every rank although each sees other loads
    torch.manual_seed(0)
    gate = TopKGate(6, E, min_capacity=0, drop_tokens=False, bias_update_speed=0.1)
    gate.train()
    for step in range(3):
        gate.route(skewed(16, 6, 10 * step + rank))
    local = gate.route(skewed(16, 6, 99 + rank)).exp_counts
    return dict(cap=combine.shape[2], local_max=int(counts.max()), dispatched=int(dispatch.sum()),
                cap2=top2[1].shape[2], dispatched2=int(top2[2].sum()), bias=gate.expert_bias.tolist(),
                local=local.tolist())


def test_dropless_and_bias_on_two_ranks():
    out = spawn(_two_rank_checks, world_size=2)
    assert [o["local_max"] for o in out] == [7, 4]
    assert [o["cap"] for o in out] == [7, 7]  # the global largest load
    assert [o["dispatched"] for o in out] == [12, 12]  # nothing dropped
    assert out[0]["cap2"] == out[1]["cap2"] and [o["dispatched2"] for o in out] == [24, 24]
    assert out[0]["bias"] == out[1]["bias"] and any(b != 0 for b in out[0]["bias"])
    assert out[0]["local"] != out[1]["local"]


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,match", [
    (dict(k=0), "k must be"), (dict(k=5), "k must be"), (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(eval_capacity_factor=-1.0), "eval_capacity_factor"), (dict(min_capacity=-1), "min_capacity"),
    (dict(noisy_gate_policy="Gumbel"), "noisy_gate_policy"), (dict(bias_update_speed=-0.1), "bias_update_speed"),
])
def test_bad_gate_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TopKGate(4, 4, **kwargs)


def test_bad_calls():
    with pytest.raises(ValueError, match="num_experts"):
        TopKGate(4, 0)
    for policy in (None, "None", "Jitter", "RSample"):
        TopKGate(4, 4, noisy_gate_policy=policy)
    gate = TopKGate(4, 4, min_capacity=0)
    with pytest.raises(NotImplementedError, match="Tutel"):
        gate(torch.randn(8, 4), use_tutel=True)
    with pytest.raises(NotImplementedError, match="Tutel"):
        top1gating(torch.randn(8, 4), 1.0, 0, use_tutel=True)
    with pytest.raises(ValueError, match="used_token"):
        gate.route(torch.randn(8, 4), used_token=torch.ones(7))
    with pytest.raises(ValueError, match="input must have shape"):
        gate.route(torch.randn(8, 5))
    with pytest.raises(ValueError, match="drop_policy"):
        topkgating(torch.randn(8, 4), 3, 1.0, 0, drop_policy="random")
    with pytest.raises(ValueError, match="k must be"):
        topkgating(torch.randn(8, 4), 5, 1.0, 0)
    with pytest.raises(ValueError, match="capacity_factor"):
        top2gating(torch.randn(8, 4), 0.0, 0)
    gate._set_ep_group(object())
    with pytest.raises(RuntimeError, match="ep_group"):
        gate._set_ep_group(object())
