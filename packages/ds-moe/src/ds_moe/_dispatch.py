"""Token dispatch into the ``[E, C, M]`` expert buffer, the expert-parallel all-to-all, and the combine.

The routes are in DeepSpeed 0.19.8's sparse form (``sparse_routes=True`` of its gating functions): per route
``[k, S]`` (route 0 the first choice of every token) an expert index (``-1``: dropped by capacity), a location
in that expert's capacity buffer and a gate weight. `route_slots` turns them into one flat row of the
``[E * C]`` buffer per route, a dropped route pointing at one extra scratch row; `sparse_encode` fills the buffer
with a single gather (each row names its source token, empty rows read a zero row), `sparse_decode` gathers
each route's result back and sums the routes weighted by their gates. Only the ``S * k`` routed rows move, never
the dense ``[S, E, C]`` one-hot einsum, and nothing waits on the device (no data-dependent size).
"""

from __future__ import annotations

import torch

import ds_comm


def _check_routes(name: str, routes: torch.Tensor, like: torch.Tensor | None = None) -> None:
    if routes.dim() != 2:
        raise ValueError(f"{name} must be [k, tokens] (one row per route), got shape {tuple(routes.shape)}")
    if like is not None and routes.shape != like.shape:
        raise ValueError(f"{name} must have the shape of the routes {tuple(like.shape)}, got {tuple(routes.shape)}")


def route_slots(indices: torch.Tensor, locations: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """DeepSpeed's ``_route_slots``: the flat row ``expert * capacity + location`` of the ``[E * C]`` expert
    buffer for every route (``[k, S]`` int64). A route whose expert index is negative (dropped by capacity)
    gets the scratch row ``E * C``, which `sparse_encode` and `sparse_decode` cut off."""
    _check_routes("indices", indices)
    _check_routes("locations", locations, indices)
    row = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, row, torch.full_like(row, num_experts * capacity))


def sparse_encode(tokens: torch.Tensor, slots: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """DeepSpeed's ``_sparse_encode``: ``[S, M]`` tokens -> the ``[E, C, M]`` expert buffer, each routed token
    copied to its slot (`route_slots`), slots no route fills zero. Differentiable w.r.t. ``tokens``."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [tokens, model_dim], got shape {tuple(tokens.shape)}")
    _check_routes("slots", slots)
    num_tokens, width = tokens.shape
    if slots.shape[1] != num_tokens:
        raise ValueError(f"slots cover {slots.shape[1]} tokens, tokens has {num_tokens}")
    # Which token fills each buffer row (num_tokens: the zero pad row); the scratch row E * C absorbs the
    # dropped routes and is cut off.
    source = torch.full((num_experts * capacity + 1,), num_tokens, dtype=torch.long, device=slots.device)
    token_ids = torch.arange(num_tokens, device=slots.device).expand_as(slots)
    source.scatter_(0, slots.reshape(-1), token_ids.reshape(-1))
    padded = torch.cat([tokens, tokens.new_zeros(1, width)])
    return padded.index_select(0, source[:-1]).view(num_experts, capacity, width)


def sparse_decode(expert_output: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor,
                  num_tokens: int) -> torch.Tensor:
    """DeepSpeed's ``_sparse_decode``: the flat ``[E * C, M]`` expert outputs -> ``[S, M]``, each token's routes
    gathered from their slots and summed weighted by ``gates`` (``[k, S]``), accumulated in the promoted dtype of
    the outputs and the gates (fp32 gates: fp32, as DeepSpeed) and cast back to the outputs' dtype. A dropped
    route reads a zero row. Differentiable w.r.t. the expert outputs and the gates."""
    if expert_output.dim() != 2:
        raise ValueError(f"expert_output must be the flat [experts * capacity, width] buffer, got shape "
                         f"{tuple(expert_output.shape)}")
    _check_routes("slots", slots)
    _check_routes("gates", gates, slots)
    if slots.shape[1] != num_tokens:
        raise ValueError(f"slots cover {slots.shape[1]} tokens, num_tokens is {num_tokens}")
    width = expert_output.shape[1]
    padded = torch.cat([expert_output, expert_output.new_zeros(1, width)])  # the scratch row: 0
    routed = padded.index_select(0, slots.reshape(-1)).view(slots.shape[0], num_tokens, width)
    return (routed * gates.unsqueeze(-1)).sum(0).to(expert_output.dtype)


def _routing_slots(routing, num_experts: int) -> torch.Tensor:
    """`route_slots` of a `Routing` (``[S, k]`` per token and choice) in the route-major ``[k, S]`` form."""
    indices = torch.where(routing.kept, routing.expert, torch.full_like(routing.expert, -1))
    return route_slots(indices.t(), routing.slot.t(), num_experts, int(routing.capacity))


def dispatch(tokens: torch.Tensor, routing, num_experts: int) -> torch.Tensor:
    """``[S, M]`` tokens -> ``[E, C, M]`` buffer: each kept choice of the `Routing` copied to its (expert, slot);
    empty slots 0. Differentiable w.r.t. ``tokens``."""
    return sparse_encode(tokens, _routing_slots(routing, num_experts), num_experts, int(routing.capacity))


def combine(expert_output: torch.Tensor, routing, num_tokens: int) -> torch.Tensor:
    """``[E, C, M]`` expert outputs -> ``[S, M]``: each token's kept choices summed, weighted by
    ``routing.weight`` (`sparse_decode`). A token with every choice dropped gets 0. Differentiable w.r.t. the
    expert outputs and the weights."""
    num_experts, capacity, width = expert_output.shape
    weight = routing.weight * routing.kept.to(routing.weight.dtype)
    return sparse_decode(expert_output.reshape(num_experts * capacity, width), _routing_slots(routing, num_experts),
                         weight.t(), num_tokens)


class AllToAll(torch.autograd.Function):
    """DeepSpeed's ``_AllToAll``: ``AllToAll.apply(group, input)`` is ``ds_comm.all_to_all_single`` of ``input``
    over ``group`` on dimension 0 (equal chunks, one per rank); the backward is the same all-to-all of the
    gradient (its own inverse). `MOELayer` sends tokens to the experts and back through ``AllToAll.apply``
    (twice per forward when ``ep_size > 1``, never otherwise)."""

    @staticmethod
    def forward(ctx, group, input: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        ds_comm.all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return None, AllToAll.apply(ctx.group, grad_output.contiguous())


def all_to_all(group, tensor: torch.Tensor) -> torch.Tensor:
    """Differentiable all-to-all of ``tensor``'s dimension 0 over ``group`` (``AllToAll.apply``)."""
    return AllToAll.apply(group, tensor)
