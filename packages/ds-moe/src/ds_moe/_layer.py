"""`MOELayer` (gate, dispatch, all-to-all, experts, all-to-all back, combine) and `MoE`, DeepSpeed's layer."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn
from torch.nn import functional as F

import ds_comm

from . import _groups as groups
from ._dispatch import all_to_all, combine, dispatch
from ._experts import Experts
from ._gating import TopKGate

logger = logging.getLogger(__name__)

# DeepSpeed's timer names (sharded_moe.py).
TOPK_GATE_TIMER = "topk_gate"
MOE_TIMER = "moe"
FIRST_ALLTOALL_TIMER = "1st_a2a"
SECOND_ALLTOALL_TIMER = "2nd_a2a"


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


class MOELayer(nn.Module):
    """DeepSpeed's ``MOELayer(gate, experts, ep_group_name, ep_size, num_local_experts, use_tutel=False)``.

    ``forward(input, used_token=None)``: ``input [..., M]`` is flattened to ``S`` tokens, routed by
    ``gate.route`` (a `Routing`), placed in an ``[E, C, M]`` buffer (``E = ep_size * num_local_experts``),
    sent by all-to-all over the expert-parallel group (rank ``r`` receives the rows of its experts
    ``r * num_local_experts ...``), run through the local experts, sent back, and combined weighted by the
    routing weights. Sets ``l_aux`` and ``exp_counts``. With ``wall_clock_breakdown = True`` it records, in
    milliseconds, ``time_moe``, ``time_falltoall``, ``time_salltoall`` (and the ``timings`` dict by
    DeepSpeed's timer names).

    As in DeepSpeed, every rank of the expert-parallel group must get the same capacity ``C`` (the same
    number of tokens, or ``drop_tokens=False`` where the gate agrees on it over the group).
    """

    def __init__(self, gate: nn.Module, experts: nn.Module, ep_group_name, ep_size, num_local_experts: int,
                 use_tutel: bool = False) -> None:
        super().__init__()
        if use_tutel:
            raise NotImplementedError("MOELayer: use_tutel=True (Tutel's fused dispatch) is not built in ds-moe; "
                                      "ds-moe's own sparse dispatch runs instead with use_tutel=False")
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.time_falltoall = 0.0
        self.time_salltoall = 0.0
        self.time_moe = 0.0
        self.timings: dict[str, float] = {}
        self.wall_clock_breakdown = False
        self.use_tutel = False
        self.l_aux = None
        self.exp_counts = None

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group
        if getattr(self.gate, "ep_group", None) is not ep_group:
            self.gate._set_ep_group(ep_group)

    def _start(self, t: float, device: torch.device) -> float:
        if not self.wall_clock_breakdown:
            return t
        _sync(device)
        return time.perf_counter()

    def _mark(self, name: str, start: float, device: torch.device) -> float:
        if not self.wall_clock_breakdown:
            return start
        _sync(device)
        now = time.perf_counter()
        self.timings[name] = (now - start) * 1e3
        return now

    def forward(self, *input: torch.Tensor, **kwargs) -> torch.Tensor:
        x = input[0]
        used_token = input[1] if len(input) > 1 else kwargs.get("used_token")
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(f"MOELayer: ep_size={self.ep_size} but no expert-parallel group is set; call "
                               "MoE.set_deepspeed_parallelism() (or _set_ep_group) first")
        device = x.device
        if self.wall_clock_breakdown:
            _sync(device)
        t_moe = t = time.perf_counter()
        d_model = x.shape[-1]
        tokens = x.reshape(-1, d_model)
        routing = self.gate.route(tokens, used_token)
        self.l_aux, self.exp_counts = routing.l_aux, routing.exp_counts
        t = self._mark(TOPK_GATE_TIMER, t, device)
        num_experts = self.ep_size * self.num_local_experts
        capacity = int(routing.capacity)
        buffer = dispatch(tokens, routing, num_experts)  # [E, C, M], E in (destination rank, local expert) order
        t = self._start(t, device)
        if self.ep_size > 1:
            buffer = all_to_all(self.ep_group, buffer)  # now (source rank, local expert)
        t = self._mark(FIRST_ALLTOALL_TIMER, t, device)
        self.time_falltoall = self.timings.get(FIRST_ALLTOALL_TIMER, 0.0)
        # [ep, E_local, C, M] -> [E_local, ep * C, M]: each local expert sees the tokens of every source rank.
        local = buffer.reshape(self.ep_size, self.num_local_experts, capacity, d_model).transpose(0, 1)
        out = self.experts(local.reshape(self.num_local_experts, self.ep_size * capacity, d_model))
        width = out.shape[-1]
        out = out.reshape(self.num_local_experts, self.ep_size, capacity, width).transpose(0, 1)
        out = out.reshape(num_experts, capacity, width)
        t = self._start(t, device)
        if self.ep_size > 1:
            out = all_to_all(self.ep_group, out)
        self._mark(SECOND_ALLTOALL_TIMER, t, device)
        self.time_salltoall = self.timings.get(SECOND_ALLTOALL_TIMER, 0.0)
        combined = combine(out, routing, tokens.shape[0])
        result = combined.reshape(*x.shape[:-1], width)
        self._mark(MOE_TIMER, t_moe, device)
        self.time_moe = self.timings.get(MOE_TIMER, 0.0)
        return result


def _positive_int(where: str, name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")


class MoE(nn.Module):
    """DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``) plus ``bias_update_speed`` (auxiliary-loss-free
    balancing, see `TopKGate`).

    ``output, l_aux, exp_counts = moe(hidden_states, used_token=None)`` with ``hidden_states [..., hidden_size]``.
    ``num_experts`` experts (deep copies of ``expert``) are split over ``ep_size`` expert-parallel ranks,
    ``num_experts // ep_size`` on each. ``use_residual=True`` is PR-MoE: ``expert`` itself runs densely as
    ``mlp`` beside the experts, mixed by ``softmax(coefficient(x))``.

    The expert groups (``"ep_size_<ep_size>"``) are made by `set_deepspeed_parallelism`, or on the first
    forward if nobody called it and a process group exists; without a process group an ``ep_size=1`` layer
    runs locally.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True, bias_update_speed: float = 0.0) -> None:
        super().__init__()
        where = "MoE"
        _positive_int(where, "hidden_size", hidden_size)
        if not isinstance(expert, nn.Module):
            raise ValueError(f"MoE: expert must be a torch.nn.Module, got {type(expert).__name__}")
        _positive_int(where, "num_experts", num_experts)
        _positive_int(where, "ep_size", ep_size)
        if num_experts % ep_size:
            raise ValueError(f"MoE: num_experts ({num_experts}) must be divisible by ep_size ({ep_size})")
        _positive_int(where, "k", k)
        if k > num_experts:
            raise ValueError(f"MoE: k ({k}) must be at most num_experts ({num_experts})")
        for name, value in (("capacity_factor", capacity_factor), ("eval_capacity_factor", eval_capacity_factor)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"MoE: {name} must be > 0, got {value!r}")
        if isinstance(min_capacity, bool) or not isinstance(min_capacity, int) or min_capacity < 0:
            raise ValueError(f"MoE: min_capacity must be an int >= 0, got {min_capacity!r}")
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ValueError(f"MoE: noisy_gate_policy must be None, 'None', 'Jitter' or 'RSample', got "
                             f"{noisy_gate_policy!r}")
        if use_tutel:
            raise NotImplementedError("MoE: use_tutel=True (Tutel's fused dispatch) is not built in ds-moe; "
                                      "leave it False (ds-moe's sparse dispatch is used)")
        if enable_expert_tensor_parallelism:
            raise NotImplementedError("MoE: enable_expert_tensor_parallelism=True (expert tensor parallelism) "
                                      "is not built in ds-moe 0.1.0")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        logger.info("Creating MoE layer with num_experts: %d | num_local_experts: %d | expert_parallel_size: %d",
                    num_experts, self.num_local_experts, ep_size)
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling,
                        bias_update_speed=bias_update_speed)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create the ``"ep_size_<N>"`` expert groups if they do not exist (every rank, same order) and give
        this layer its expert-parallel group."""
        self._create_process_groups(use_data_before_expert_parallel_=use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        if not ds_comm.is_initialized():
            raise RuntimeError("MoE.set_deepspeed_parallelism: no process group; call ds_comm.init_distributed() "
                               "first")
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            logger.info("No existing process group found, creating a new group named: %s", self.expert_group_name)
            groups._create_expert_and_data_parallel(self.ep_size,
                                                    use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self.deepspeed_moe._set_ep_group(groups._get_expert_parallel_group(self.expert_group_name))

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        """Returns ``(output, l_aux, exp_counts)``."""
        if self.deepspeed_moe.ep_group is None:
            if ds_comm.is_initialized():
                self.set_deepspeed_parallelism()
            elif self.ep_size > 1:
                raise RuntimeError(f"MoE: ep_size={self.ep_size} needs a process group; call "
                                   "ds_comm.init_distributed() first")
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
