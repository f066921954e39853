"""Token dispatch into the ``[E, C, M]`` expert buffer, the expert-parallel all-to-all, and the combine.

Dispatch and combine move only the ``S * k`` routed rows (``index_add`` / ``index_select`` on the flat
``[E * C, M]`` buffer), never the dense ``[S, E, C]`` one-hot einsum, and never wait on the device (a dropped
choice goes to a scratch row that is cut off).
"""

from __future__ import annotations

import torch

import ds_comm


def _rows(routing, num_experts: int, capacity: int) -> torch.Tensor:
    """``[S * k]`` flat buffer row ``expert * C + slot`` of every choice; a dropped choice points at the extra
    scratch row ``E * C`` (so nothing needs a data-dependent size, nor a host sync)."""
    row = routing.expert.reshape(-1) * capacity + routing.slot.reshape(-1)
    return torch.where(routing.kept.reshape(-1), row, torch.full_like(row, num_experts * capacity))


def dispatch(tokens: torch.Tensor, routing, num_experts: int) -> torch.Tensor:
    """``[S, M]`` tokens -> ``[E, C, M]`` buffer: each kept choice copied to its (expert, slot); empty slots 0.
    Differentiable w.r.t. ``tokens``."""
    capacity = int(routing.capacity)
    num_tokens, width = tokens.shape
    k = routing.expert.shape[1]
    rows = _rows(routing, num_experts, capacity)
    buffer = tokens.new_zeros(num_experts * capacity + 1, width)  # + the scratch row of the dropped choices
    source = tokens.unsqueeze(1).expand(num_tokens, k, width).reshape(num_tokens * k, width)
    buffer = buffer.index_add(0, rows, source)
    return buffer[:-1].view(num_experts, capacity, width)


def combine(expert_output: torch.Tensor, routing, num_tokens: int) -> torch.Tensor:
    """``[E, C, M]`` expert outputs -> ``[S, M]``: each token's kept choices summed, weighted by
    ``routing.weight`` (accumulated in the weight's dtype, as DeepSpeed's, then cast to the output's). A
    dropped choice contributes 0; a token with every choice dropped gets 0. Differentiable w.r.t. the
    expert outputs and the weights."""
    num_experts, capacity, width = expert_output.shape
    k = routing.expert.shape[1]
    rows = _rows(routing, num_experts, capacity)
    padded = torch.cat([expert_output.reshape(-1, width), expert_output.new_zeros(1, width)])  # scratch row: 0
    routed = padded.index_select(0, rows).view(num_tokens, k, width)
    weight = routing.weight * routing.kept.to(routing.weight.dtype)
    out = (routed.to(weight.dtype) * weight.unsqueeze(-1)).sum(1)
    return out.to(expert_output.dtype)


class _AllToAll(torch.autograd.Function):
    """``ds_comm.all_to_all_single`` over ``group`` on dimension 0 (split in equal chunks, one per rank);
    the backward is the same all-to-all of the gradient (its own inverse)."""

    @staticmethod
    def forward(ctx, group, input: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        ds_comm.all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return None, _AllToAll.apply(ctx.group, grad_output.contiguous())


def all_to_all(group, tensor: torch.Tensor) -> torch.Tensor:
    """Differentiable all-to-all of ``tensor``'s dimension 0 over ``group``."""
    return _AllToAll.apply(group, tensor)
