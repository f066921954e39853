"""DeepSpeed's ``deepspeed.moe.utils``: telling expert parameters apart and grouping them for the optimizer."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

import ds_comm

from . import _groups as groups
from ._layer import MoE

_EXPERTS_PREFIX = "deepspeed_moe.experts.deepspeed_experts."


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """``(True, num_experts of the first MoE layer)`` if ``m`` holds an `MoE`, else ``(False, 0)``."""
    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """An expert parameter: one marked ``allreduce = False``."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(params) -> tuple[list, list]:
    """``(shared, expert)`` parameters, in order."""
    shared, expert = [], []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(group) -> tuple[list, list]:
    """``(shared grads, expert grads)`` of the parameters that have a gradient, each cast to its parameter's
    dtype (for gradient norms and overflow checks)."""
    shared, expert = [], []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971) -> list[dict]:
    """DeepSpeed's split: the expert parameters leave their group; for each (group, expert group name) a new
    group ``{**group, "name": <expert group name>, "moe": True, "params": [...]}`` is appended, cut into
    pieces of at most ``max_group_size`` elements (``None``: not cut). Mutates and returns the list (a dict
    or tuple becomes a new list)."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: param_groups must be a dict, "
                         f"list or tuple of dicts, got {type(param_groups).__name__}")
    names: list[str] = []
    for group in param_groups:
        for p in group["params"]:
            if is_moe_param(p) and p.group_name not in names:
                names.append(p.group_name)
    if names:
        for i, group in enumerate(param_groups):
            if "name" not in group:
                raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: parameter group {i} has "
                                 "no 'name' (every group needs one when the model has expert parameters)")
    moe_groups: dict[Any, dict[str, dict]] = defaultdict(dict)
    for group in param_groups:
        for name in names:
            moe_groups[group["name"]][name] = {**group, "name": name, "moe": True, "params": []}
    for group in param_groups:
        dense = []
        for p in group["params"]:
            if is_moe_param(p):
                moe_groups[group["name"]][p.group_name]["params"].append(p)
            else:
                dense.append(p)
        group["params"] = dense
    for by_name in list(moe_groups.values()):
        for group in by_name.values():
            if max_group_size is None:
                param_groups.append(group)
                continue
            pieces, piece, size = [], [], 0
            for p in group["params"]:
                numel = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                if size + numel <= max_group_size:
                    piece.append(p)
                    size += numel
                else:
                    pieces.append(piece)
                    piece, size = [p], numel
            if piece:
                pieces.append(piece)
            param_groups.extend({**group, "params": piece} for piece in pieces)
    return param_groups


def is_moe_param_group(param_group) -> bool:
    """A group made by `split_params_into_different_moe_groups_for_optimizer` (``"moe": True``)."""
    return param_group.get("moe", False)


def configure_moe_param_groups(model_parameters: list) -> list[dict]:
    """DeepSpeed's: a list of parameters becomes ``{"params": ..., "name": "dense-params"}`` split into MoE
    groups; a list of groups is split unless one already has a ``"moe"`` key (then returned as is)."""
    if not isinstance(model_parameters, list):
        raise ValueError(f"configure_moe_param_groups: model_parameters must be a list, got "
                         f"{type(model_parameters).__name__}")
    if not model_parameters:
        raise ValueError("configure_moe_param_groups: model_parameters is empty")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be an iterable of "
                            f"Tensors or dicts, but got {type(p).__name__}")
    if isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"})
    if any("moe" in group for group in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)


def _ep_rank(layer: MoE) -> int:
    if layer.ep_size == 1:
        return 0
    if not ds_comm.is_initialized() or layer.expert_group_name not in groups._get_expert_parallel_group_dict():
        raise RuntimeError(f"expert_checkpoint_names: the {layer.expert_group_name} expert groups do not exist; "
                           "call MoE.set_deepspeed_parallelism() (or run a forward) first")
    return groups._get_expert_parallel_rank(layer.expert_group_name)


def expert_checkpoint_names(model: nn.Module) -> dict[str, str]:
    """``{local name: global name}`` for the expert parameters and buffers whose global expert id differs
    from their local index: ``<layer>.deepspeed_moe.experts.deepspeed_experts.<i>.<rest>`` ->
    ``...deepspeed_experts.<ep_rank * num_local_experts + i>.<rest>`` (empty on expert-parallel rank 0)."""
    names: dict[str, str] = {}
    params = [name for name, _ in model.named_parameters()] + [name for name, _ in model.named_buffers()]
    for prefix, layer in model.named_modules():
        if not isinstance(layer, MoE):
            continue
        offset = _ep_rank(layer) * layer.num_local_experts
        if offset == 0:
            continue
        head = (prefix + "." if prefix else "") + _EXPERTS_PREFIX
        for name in params:
            if not name.startswith(head):
                continue
            local, _, rest = name[len(head):].partition(".")
            names[name] = f"{head}{int(local) + offset}.{rest}"
    return names
