"""Parameter groups under ZeRO: which group each trainable parameter is in, and the tensors the optimizer
steps ("runs": each bucket's stepped range split where the group changes)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._layout import FlatLayout
from ._model import param_name, short


def option_groups(param_groups: Any, model: nn.Module, params: list[nn.Parameter]
                   ) -> tuple[list[int | None], list[dict[str, Any]] | None]:
    """Each trainable parameter's group index (None: in no group, so not optimized) and the groups'
    options (None: no groups given)."""
    if param_groups is None:
        return [0] * len(params), None
    if isinstance(param_groups, dict) or not isinstance(param_groups, (list, tuple)) or \
            not all(isinstance(g, dict) and "params" in g for g in param_groups):
        raise ValueError("ZeroOptimizer: param_groups must be a list of dicts with 'params' (a torch optimizer's "
                         f"parameter groups), got {short(param_groups)}")
    where = {id(p): i for i, p in enumerate(params)}
    group_of: list[int | None] = [None] * len(params)
    options = []
    for g, group in enumerate(param_groups):
        members = [group["params"]] if torch.is_tensor(group["params"]) else list(group["params"])
        for p in members:
            i = where.get(id(p))
            if i is None:
                raise ValueError(f"ZeroOptimizer: param_groups[{g}] holds a tensor of shape {tuple(p.shape)} that is "
                                 "not a trainable parameter of the model (ZeRO optimizes exactly the parameters "
                                 "with requires_grad=True)")
            if group_of[i] is not None:
                raise ValueError(f"ZeroOptimizer: parameter {param_name(model, p)} is in param_groups[{group_of[i]}] "
                                 f"and param_groups[{g}]; each parameter belongs to one group")
            group_of[i] = g
        options.append({k: v for k, v in group.items() if k != "params"})
    if all(g is None for g in group_of):
        raise ValueError(f"ZeroOptimizer: param_groups hold none of the model's {len(params)} trainable parameters; "
                         "put the parameters to train in a group")
    # a trainable parameter in no group is not optimized (None), as in DeepSpeed, whose ZeRO optimizers
    # build their flat groups from the optimizer's param_groups only: it keeps its value
    return group_of, options  # type: ignore[return-value]


def step_runs(layout: FlatLayout, sharded: bool, rank: int, group_of: list[int]) -> list[tuple[int, int, int, int]]:
    """The tensors the optimizer steps: each bucket's range this rank steps (the whole bucket without
    ``sharded`` optimizer states, stage 0; the rank's shard with them), split where the parameters' group changes; (bucket, offset in the range,
    length, group). Padding belongs to the run before it (a range of padding only, to the bucket's last
    parameter's group)."""
    runs = []
    for bucket in layout.buckets:
        start = layout.shard_range(bucket, rank)[0] if sharded else bucket.offset
        length = bucket.shard if sharded else bucket.padded
        cuts: list[list[int]] = []  # [offset, group]
        for index in bucket.slots:
            slot = layout.slots[index]
            if slot.offset < start + length and slot.offset + slot.numel > start:
                group = group_of[index]
                if not cuts:
                    cuts.append([0, group])
                elif group != cuts[-1][1]:
                    cuts.append([slot.offset - start, group])
        if not cuts:
            cuts = [[0, group_of[bucket.slots[-1]]]]
        ends = [at for at, _ in cuts[1:]] + [length]
        runs += [(bucket.index, at, end - at, group) for (at, group), end in zip(cuts, ends, strict=True)]
    return runs


def mask_padding(optimizer: Any, tensors: list[torch.Tensor], owned: list[tuple[int, int]], layout: FlatLayout) -> None:
    """Tell a 1-bit optimizer where the parameters lie in each group's flat tensor (its runs, in order:
    ``tensors``, each at ``owned``'s offset in the flat buffer): the buckets' padding stays zero (compressed, it
    would not), and 1-bit LAMB takes its trust ratios per parameter."""
    where = {id(t): at for t, (at, _) in zip(tensors, owned, strict=True)}
    slots = sorted(layout.slots, key=lambda slot: slot.offset)
    for index, group in enumerate(optimizer.param_groups):
        segments, base = [], 0
        for t in group["params"]:  # a run holds whole parameters at stage 0
            start, end = where[id(t)], where[id(t)] + t.numel()
            segments += [(base + slot.offset - start, slot.numel) for slot in slots if start <= slot.offset < end]
            base += t.numel()
        if group["params"]:
            optimizer.set_segments(index, segments)
