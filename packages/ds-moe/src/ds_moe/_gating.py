"""The MoE gate: DeepSpeed's ``TopKGate`` and its gating functions (``deepspeed.moe.sharded_moe``).

Every gating rule is computed once, in index form (`Routing`: per token and choice the expert, the slot in
that expert's capacity buffer, the combine weight and whether it survived capacity), with per-expert
positions found by a stable sort instead of DeepSpeed's one-hot cumsums; the dense ``[S, E, C]``
``combine_weights``/``dispatch_mask`` of DeepSpeed's API are scattered from that same routing, so the
dense and the index form always agree. The arithmetic (softmax in fp32, capacities, aux losses, the
normalisation of the top-2/top-k weights, which token survives capacity, the random streams of
``RSample``, ``Jitter``, random token selection and second-expert sampling) is DeepSpeed 0.19.8's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import ds_comm

logger = logging.getLogger(__name__)

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
DROP_POLICIES = ("probs", "position")

_uniform_samplers: dict = {}
_gumbel_samplers: dict = {}


@dataclass
class Routing:
    """Where each token goes: ``[S, k]`` per token and choice (choice 0 is the first/highest).

    ``expert`` the chosen global expert (0..E-1), ``slot`` its position in that expert's capacity buffer
    (meaningful where ``kept``), ``weight`` the combine weight (differentiable w.r.t. the gate, 0 where
    dropped), ``kept`` whether the choice survived capacity, ``capacity`` C (dropless: agreed over the
    expert-parallel group), ``l_aux`` the 0-dim load-balancing loss, ``exp_counts`` [E] int64 tokens
    chosen per expert before capacity dropping (DeepSpeed's ``exp_counts``).
    """

    expert: Tensor
    slot: Tensor
    weight: Tensor
    kept: Tensor
    capacity: int
    l_aux: Tensor
    exp_counts: Tensor


def multiplicative_jitter(x: Tensor, device: torch.device, epsilon: float = 1e-2) -> Tensor:
    """Multiply ``x`` by uniform noise in ``[1 - epsilon, 1 + epsilon)`` (Switch Transformer jitter)."""
    if epsilon == 0:
        return x
    key = (torch.device(device), float(epsilon))
    sampler = _uniform_samplers.get(key)
    if sampler is None:
        sampler = torch.distributions.uniform.Uniform(torch.tensor(1.0 - epsilon, device=device),
                                                      torch.tensor(1.0 + epsilon, device=device)).rsample
        _uniform_samplers[key] = sampler
    return x * sampler(x.shape)


def gumbel_rsample(shape, device: torch.device) -> Tensor:
    """Standard Gumbel(0, 1) noise of ``shape`` on ``device``."""
    device = torch.device(device)
    sampler = _gumbel_samplers.get(device)
    if sampler is None:
        sampler = torch.distributions.gumbel.Gumbel(torch.tensor(0.0, device=device),
                                                    torch.tensor(1.0, device=device)).rsample
        _gumbel_samplers[device] = sampler
    return sampler(shape)


def _check_capacity_args(capacity_factor, min_capacity, name: str = "capacity_factor") -> None:
    if not capacity_factor > 0:
        raise ValueError(f"{name} must be > 0, got {capacity_factor!r}")
    if isinstance(min_capacity, bool) or int(min_capacity) != min_capacity or min_capacity < 0:
        raise ValueError(f"min_capacity must be an integer >= 0, got {min_capacity!r}")


def _capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """DeepSpeed's ``max(ceil(S / E * capacity_factor), min_capacity)``, with the product in fp32 as
    DeepSpeed computes it (the factor is a float32 tensor there), so edge cases round alike."""
    product = torch.tensor(capacity_factor, dtype=torch.float32) * (num_tokens / num_experts)
    return max(int(torch.ceil(product).item()), int(min_capacity))


def _is_parallel(group) -> bool:
    return group is not None and ds_comm.is_initialized() and ds_comm.get_world_size(group) > 1


def _dropless_capacity(exp_counts: Tensor, ep_group) -> int:
    """The largest expert load here, agreed (MAX) over the expert-parallel group."""
    capacity = exp_counts.max().detach().clone()
    if _is_parallel(ep_group):
        ds_comm.all_reduce(capacity, op=ds_comm.ReduceOp.MAX, group=ep_group)
    return int(capacity.item())


def _positions(expert: Tensor, valid: Tensor, num_experts: int, priority: Tensor | None = None) -> Tensor:
    """For each entry of the flat ``expert``: how many valid entries with the same expert precede it, in
    flat order, or in descending ``priority`` (ties in flat order). Invalid entries get meaningless values.

    One stable sort instead of the [S, E] one-hot cumsum: O(n log n) in the number of routes.
    """
    n = expert.numel()
    key = torch.where(valid, expert, torch.full_like(expert, num_experts))
    if priority is None:
        order = torch.argsort(key, stable=True)
    else:
        order = torch.argsort(priority, descending=True, stable=True)
        order = order[torch.argsort(key[order], stable=True)]
    counts = torch.bincount(key, minlength=num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    positions = torch.empty_like(order)
    positions[order] = torch.arange(n, device=expert.device) - starts[key[order]]
    return positions


def _used_mask(used_token, num_tokens: int, device) -> Tensor:
    if used_token is None:
        return torch.ones(num_tokens, dtype=torch.bool, device=device)
    if used_token.dim() != 1 or used_token.shape[0] != num_tokens:
        raise ValueError(f"used_token must have shape [{num_tokens}] (one entry per token), "
                         f"got {tuple(used_token.shape)}")
    return used_token.to(device) != 0


def _counts(expert: Tensor, valid: Tensor, num_experts: int) -> Tensor:
    return torch.bincount(expert[valid], minlength=num_experts).to(torch.int64)


def _with_bias(noisy_logits: Tensor, bias: Tensor | None) -> Tensor:
    """Scores to rank noisy logits by: the logits themselves (DeepSpeed), or with a balancing bias the
    softmax of them plus the bias, so the bias acts on the probability scale of every rule."""
    if bias is None:
        return noisy_logits
    return F.softmax(noisy_logits, dim=1) + bias


def _top1(logits, capacity_factor, min_capacity, used, noisy_gate_policy, drop_tokens, use_rts, ep_group, bias):
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    if noisy_gate_policy == "RSample":
        scores = _with_bias(logits + gumbel_rsample(logits.shape, device=logits.device), bias)
    else:
        scores = gates if bias is None else gates + bias
    expert = torch.argmax(scores, dim=1)
    exp_counts = _counts(expert, used, num_experts)
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    else:
        capacity = min(_dropless_capacity(exp_counts, ep_group), num_tokens)
    me = gates.mean(dim=0)
    ce = exp_counts.to(gates.dtype) / num_tokens
    l_aux = torch.sum(me * ce) * num_experts
    priority = None
    if use_rts:
        # one uniform per (token, expert) as DeepSpeed draws them; a token's priority is its expert's
        uniform = torch.rand((num_tokens, num_experts), dtype=logits.dtype, device=logits.device)
        priority = uniform.gather(1, expert.unsqueeze(1)).squeeze(1)
    if num_tokens < min_capacity:
        raise ValueError(f"top-1 gating needs at least min_capacity={min_capacity} tokens, got {num_tokens}: "
                         "set min_capacity to 0 or use a larger batch")
    kept = used & (_positions(expert, used, num_experts, priority) < capacity)
    slot = _positions(expert, kept, num_experts)  # DeepSpeed's cumsum over the kept tokens
    weight = gates.gather(1, expert.unsqueeze(1)).squeeze(1) * kept
    return Routing(expert.unsqueeze(1), slot.unsqueeze(1), weight.unsqueeze(1), kept.unsqueeze(1),
                   capacity, l_aux, exp_counts)


def _top2(logits, capacity_factor, min_capacity, used, drop_tokens, ep_group, second_sampling, bias):
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    first = torch.argmax(gates if bias is None else gates + bias, dim=1)
    if second_sampling:
        scores2 = _with_bias(logits + gumbel_rsample(logits.shape, device=logits.device), bias)
    else:
        scores2 = logits if bias is None else gates + bias
    scores2 = scores2.scatter(1, first.unsqueeze(1), float("-inf"))
    second = torch.argmax(scores2, dim=1)
    expert = torch.stack([first, second], dim=1)
    valid = used.unsqueeze(1).expand(num_tokens, 2)
    # second choices queue after every first choice: positions in choice-major order
    location = _positions(expert.t().reshape(-1), valid.t().reshape(-1), num_experts).view(2, num_tokens).t()
    count1 = _counts(first, used, num_experts)
    me = gates.mean(dim=0)
    ce = count1.to(gates.dtype) / num_tokens
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = count1 + _counts(second, used, num_experts)
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
    else:
        capacity = _dropless_capacity(exp_counts, ep_group)
    kept = valid & (location < capacity)
    chosen = gates.gather(1, expert) * kept
    denom = torch.clamp(chosen[:, 0] + chosen[:, 1], min=torch.finfo(chosen.dtype).eps)
    weight = chosen / denom.unsqueeze(1)
    return Routing(expert, location, weight, kept, capacity, l_aux, exp_counts)


def _topk(logits, k, capacity_factor, min_capacity, used, drop_tokens, ep_group, drop_policy, bias):
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    _, expert = torch.topk(gates if bias is None else gates + bias, k=k, dim=1)
    top_gate = gates.gather(1, expert)
    valid = used.unsqueeze(1).expand(num_tokens, k)
    flat_expert, flat_valid = expert.reshape(-1), valid.reshape(-1)
    exp_counts = _counts(flat_expert, flat_valid, num_experts)
    me = gates.mean(dim=0)
    ce = exp_counts.to(gates.dtype) / num_tokens
    l_aux = torch.mean(me * ce) * num_experts * num_experts / k
    if not drop_tokens:
        capacity = _dropless_capacity(exp_counts, ep_group)
        kept = valid
    else:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            rank = _positions(flat_expert, flat_valid, num_experts, priority=top_gate.detach().reshape(-1))
        else:
            rank = _positions(flat_expert, flat_valid, num_experts)
        kept = valid & (rank.view(num_tokens, k) < capacity)
    # token-major flat order keeps each expert's routes in token order: DeepSpeed's cumsum after dropping
    slot = _positions(flat_expert, kept.reshape(-1), num_experts).view(num_tokens, k)
    chosen = top_gate * kept
    # the sum over the [S, E] masked gates, in expert order as DeepSpeed adds them (bit-equal weights)
    total = torch.zeros_like(gates).scatter(1, expert, chosen).sum(dim=1, keepdim=True)
    denom = torch.clamp(total, min=torch.finfo(chosen.dtype).eps)
    return Routing(expert, slot, chosen / denom, kept, capacity, l_aux, exp_counts)


def _dense(routing: Routing, num_experts: int) -> tuple[Tensor, Tensor]:
    """DeepSpeed's ``combine_weights`` [S, E, C] and ``dispatch_mask`` from a routing."""
    num_tokens, k = routing.expert.shape
    device, capacity = routing.weight.device, routing.capacity
    kept = routing.kept
    tokens = torch.arange(num_tokens, device=device).unsqueeze(1).expand(num_tokens, k)[kept]
    index = (tokens, routing.expert[kept], routing.slot[kept])
    combine = torch.zeros(num_tokens, num_experts, capacity, dtype=routing.weight.dtype, device=device)
    combine = combine.index_put(index, routing.weight[kept])
    dispatch = torch.zeros(num_tokens, num_experts, capacity, dtype=torch.bool, device=device)
    dispatch[index] = True
    return combine, dispatch


def _sparse(routing: Routing, num_experts: int) -> tuple:
    """DeepSpeed 0.19.8's ``sparse_routes`` tuple: ``(l_aux, capacity, E, indices, locations, gates,
    exp_counts)``, per route ``[k, S]``, dropped routes with expert index -1 and location 0."""
    kept = routing.kept
    indices = torch.where(kept, routing.expert, torch.full_like(routing.expert, -1))
    locations = routing.slot * kept
    capacity = torch.tensor(routing.capacity, dtype=torch.int64, device=routing.weight.device)
    return (routing.l_aux, capacity, num_experts, indices.t().contiguous().to(torch.int32),
            locations.t().contiguous().to(torch.int32), routing.weight.t().contiguous(), routing.exp_counts)


def _output(routing: Routing, num_experts: int, sparse_routes: bool):
    if sparse_routes:
        return _sparse(routing, num_experts)
    combine, dispatch = _dense(routing, num_experts)
    return routing.l_aux, combine, dispatch, routing.exp_counts


def _refuse_tutel(use_tutel: bool) -> None:
    if use_tutel:
        raise NotImplementedError("use_tutel=True: Tutel is not built in ds-moe (its dispatch is index-based "
                                  "already); pass use_tutel=False")


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor | None = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group=None, sparse_routes: bool = False, use_tutel: bool = False):
    """Switch (top-1) gating on fp32 ``logits`` [S, E]: DeepSpeed's ``(l_aux, combine_weights [S,E,C],
    dispatch_mask [S,E,C], exp_counts [E])`` (or its ``sparse_routes`` tuple)."""
    _refuse_tutel(use_tutel)
    _check_capacity_args(capacity_factor, min_capacity)
    _check_policy(noisy_gate_policy)
    used = _used_mask(used_token, logits.shape[0], logits.device)
    routing = _top1(logits, capacity_factor, min_capacity, used, noisy_gate_policy, drop_tokens, use_rts,
                    ep_group, None)
    return _output(routing, logits.shape[1], sparse_routes)


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, top2_2nd_expert_sampling: bool = True, sparse_routes: bool = False):
    """GShard (top-2) gating on fp32 ``logits`` [S, E]; outputs as `top1gating`. With
    ``top2_2nd_expert_sampling`` the second expert is drawn with Gumbel noise (as DeepSpeed, always:
    `TopKGate` passes it in training only)."""
    _check_capacity_args(capacity_factor, min_capacity)
    used = _used_mask(None, logits.shape[0], logits.device)
    routing = _top2(logits, capacity_factor, min_capacity, used, drop_tokens, ep_group,
                    top2_2nd_expert_sampling, None)
    return _output(routing, logits.shape[1], sparse_routes)


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, drop_policy: str = "probs", sparse_routes: bool = False):
    """General top-k gating on fp32 ``logits`` [S, E]; outputs as `top1gating`. ``drop_policy='probs'``
    keeps the ``capacity`` most probable routes per expert, ``'position'`` the first ones."""
    _check_k(k, logits.shape[1])
    _check_capacity_args(capacity_factor, min_capacity)
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    used = _used_mask(None, logits.shape[0], logits.device)
    routing = _topk(logits, k, capacity_factor, min_capacity, used, drop_tokens, ep_group, drop_policy, None)
    return _output(routing, logits.shape[1], sparse_routes)


def _check_k(k, num_experts) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"k must be an integer in [1, num_experts={num_experts}], got {k!r}")


def _check_policy(noisy_gate_policy) -> None:
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"noisy_gate_policy must be one of {NOISY_GATE_POLICIES}, got {noisy_gate_policy!r}")


class TopKGate(nn.Module):
    """DeepSpeed's MoE gate: a float32 ``wg`` Linear (model_dim -> num_experts, no bias) scoring each
    token, then top-1 (Switch), top-2 (GShard) or top-k gating with capacity ``capacity_factor`` (training)
    or ``eval_capacity_factor`` (eval), at least ``min_capacity``; ``drop_tokens=False`` is dropless (the
    capacity is the largest expert load, agreed over ``ep_group``). ``noisy_gate_policy``: ``'Jitter'``
    multiplies the input by uniform noise in [0.99, 1.01) (training, any k), ``'RSample'`` adds Gumbel
    noise to the logits for the top-1 choice (training; DeepSpeed ignores it for k >= 2, so does this gate,
    with a warning). ``use_rts`` picks which top-1 tokens survive capacity by a uniform random priority
    (else the first ones). ``top2_2nd_expert_sampling`` draws the second of two experts with Gumbel noise
    (training only here; DeepSpeed samples in eval too).

    Auxiliary-loss-free balancing (DeepSeek-V3), beyond DeepSpeed: ``bias_update_speed > 0`` keeps a
    per-expert float32 buffer ``expert_bias`` (checkpointed with the module) that is added to the
    probabilities each rule ranks (the softmax of the logits; for ``'RSample'`` and the sampled second
    expert, the softmax of the noisy logits) to choose the experts only: combine weights and capacity
    dropping use the unbiased probabilities. After every training-mode routing ``expert_bias += bias_update_speed *
    sign(mean_load - load)``, with the loads (routes chosen per expert, before capacity) summed over every
    rank (all-reduce over the default group when ds_comm is initialised, so replicas keep the same bias).
    ``l_aux`` is then a 0-dim zero tensor (adding it to the loss changes nothing).

    ``route(input)`` returns the `Routing` (index form, what `MOELayer` dispatches with); ``forward``
    returns DeepSpeed's dense ``(l_aux, combine_weights [S,E,C], dispatch_mask [S,E,C], exp_counts)``
    built from the same routing (or DeepSpeed 0.19.8's ``sparse_routes`` tuple).
    """

    wg: nn.Linear

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group=None,
                 top2_2nd_expert_sampling: bool = True, bias_update_speed: float = 0.0) -> None:
        super().__init__()
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be an integer >= 1, got {num_experts!r}")
        _check_k(k, num_experts)
        _check_capacity_args(capacity_factor, min_capacity)
        _check_capacity_args(eval_capacity_factor, min_capacity, name="eval_capacity_factor")
        _check_policy(noisy_gate_policy)
        if not bias_update_speed >= 0:
            raise ValueError(f"bias_update_speed must be >= 0 (0: off), got {bias_update_speed!r}")
        if noisy_gate_policy == "RSample" and k > 1:
            logger.warning("noisy_gate_policy='RSample' applies to top-1 gating only; with k=%d it is ignored "
                           "(as in DeepSpeed)", k)
        self.wg = nn.Linear(model_dim, num_experts, bias=False).float()
        self.ep_group = ep_group
        self.k = k
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.bias_update_speed = float(bias_update_speed)
        self.wall_clock_breakdown = False
        self.gate_time = 0.0
        if self.bias_update_speed > 0:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def _set_ep_group(self, ep_group) -> None:
        if self.ep_group is not None:
            raise RuntimeError("TopKGate already has an ep_group; it cannot be replaced")
        self.ep_group = ep_group

    def _logits(self, input: Tensor) -> Tensor:
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x, device=input.device)
        return F.linear(x, self.wg.weight.float())

    def route(self, input: Tensor, used_token: Tensor | None = None) -> Routing:
        """Route ``input`` [S, model_dim]: the `Routing` (index form) the layer dispatches with."""
        if input.dim() != 2 or input.shape[1] != self.wg.in_features:
            raise ValueError(f"input must have shape [tokens, {self.wg.in_features}], got {tuple(input.shape)}")
        logits = self._logits(input)
        used = _used_mask(used_token, logits.shape[0], logits.device)
        capacity_factor = self.capacity_factor if self.training else self.eval_capacity_factor
        bias = None if self.expert_bias is None else self.expert_bias.to(device=logits.device, dtype=torch.float32)
        if self.k == 1:
            policy = self.noisy_gate_policy if self.training else None
            routing = _top1(logits, capacity_factor, self.min_capacity, used, policy, self.drop_tokens,
                            self.use_rts, self.ep_group, bias)
        elif self.k == 2:
            routing = _top2(logits, capacity_factor, self.min_capacity, used, self.drop_tokens, self.ep_group,
                            self.top2_2nd_expert_sampling and self.training, bias)
        else:
            routing = _topk(logits, self.k, capacity_factor, self.min_capacity, used, self.drop_tokens,
                            self.ep_group, "probs", bias)
        if self.expert_bias is not None:
            routing.l_aux = torch.zeros((), dtype=logits.dtype, device=logits.device)
            if self.training:
                self._update_bias(routing.exp_counts)
        return routing

    @torch.no_grad()
    def _update_bias(self, exp_counts: Tensor) -> None:
        load = exp_counts.to(torch.float32)
        if ds_comm.is_initialized() and ds_comm.get_world_size() > 1:
            ds_comm.all_reduce(load, op=ds_comm.ReduceOp.SUM)
        step = torch.sign(load.mean() - load) * self.bias_update_speed
        self.expert_bias.add_(step.to(self.expert_bias.device))

    def forward(self, input: Tensor, used_token: Tensor | None = None, sparse_routes: bool = False,
                use_tutel: bool = False):
        """DeepSpeed's gate call: ``(l_aux, combine_weights, dispatch_mask, exp_counts)``, dense
        ``[S, E, C]`` (``sparse_routes=True``: DeepSpeed 0.19.8's per-route tuple)."""
        _refuse_tutel(use_tutel)
        return _output(self.route(input, used_token), self.num_experts, sparse_routes)
