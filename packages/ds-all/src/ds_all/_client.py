"""A client's optimizer and ``model_parameters`` under ZeRO: ZeRO steps flat tensors of its own, so
the client's optimizer is rebound to them (its groups' options and the object kept, as DeepSpeed's
ZeRO rebinds the client optimizer's groups), and a schedule built on it keeps working. Groups with
options of their own (no weight decay for biases and norms, say) are handed to ZeRO, which splits
its tensors where the group changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _groups(model_parameters: Any) -> list[dict[str, Any]]:
    items = list(model_parameters)
    if items and all(isinstance(item, dict) for item in items):
        groups = [dict(item, params=[item["params"]] if torch.is_tensor(item["params"]) else list(item["params"]))
                  for item in items]
        return [group for group in groups if group["params"]]  # DeepSpeed drops the empty groups
    if all(isinstance(item, torch.Tensor) for item in items):
        return [{"params": items}]
    if all(isinstance(item, tuple) and len(item) == 2 for item in items):  # named_parameters()
        return [{"params": [p for _, p in items]}]
    raise ValueError("initialize: model_parameters must be parameters, (name, parameter) pairs or parameter "
                     f"groups (dicts with 'params'), got a list of {sorted({type(i).__name__ for i in items})}")


def _trainable_only(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The groups without their frozen parameters (``requires_grad=False``): DeepSpeed's ZeRO leaves them
    out of its groups (they are never stepped); a group left empty is kept, with its options."""
    return [dict(group, params=[p for p in group["params"] if p.requires_grad]) for group in groups]


def _check_groups(groups: list[dict[str, Any]], trainable: list[torch.Tensor], what: str) -> list[dict[str, Any]] | None:
    """The groups ZeRO is given (their frozen parameters left out): None for one group without options of
    its own (the optimizer's defaults apply), else the groups."""
    groups = _trainable_only(groups)
    given = {id(p) for group in groups for p in group["params"]}
    wanted = {id(p) for p in trainable}
    if not given <= wanted or not given:
        raise ValueError(f"initialize: {what} hold {len(given & wanted)} of the model's {len(wanted)} trainable "
                         f"parameters and {len(given - wanted)} others; ZeRO optimizes trainable parameters of the "
                         "model (requires_grad=True; frozen ones are left out) only, and at least one")
    # a trainable parameter in no group is not optimized (it keeps its value), as in DeepSpeed
    if len(groups) == 1 and set(groups[0]) == {"params"} and given == wanted:
        return None
    return groups


def model_parameter_groups(model_parameters: Any, trainable: list[torch.Tensor]) -> list[dict[str, Any]] | None:
    """``model_parameters`` must be parameters of the model, trainable ones among them (frozen ones are
    accepted and left out, as DeepSpeed's ZeRO leaves them out); their groups, as ZeRO takes them (None:
    one group without options)."""
    return _check_groups(_groups(model_parameters), trainable, "model_parameters")


def rebinder(optimizer: torch.optim.Optimizer, trainable: list[torch.Tensor]
             ) -> tuple[Callable, list[dict[str, Any]] | None]:
    """A factory for `ds_zero.ZeroOptimizer` that rebinds ``optimizer`` (built by the client over the
    model's parameters, not stepped yet) to ZeRO's tensors, keeping its groups' options and the object;
    and the groups to give ZeRO (None for one group)."""
    if optimizer.state:
        raise ValueError("initialize: the optimizer has state already (it was stepped); pass a fresh optimizer")
    groups = [dict(group) for group in optimizer.param_groups if group["params"]]  # DeepSpeed drops empty ones
    _check_groups(groups, trainable, "the optimizer's parameter groups")
    groups = _trainable_only(groups)  # its frozen parameters are not stepped (DeepSpeed's ZeRO drops them)
    covered = sum(len(group["params"]) for group in groups)
    zero_groups = groups if len(groups) > 1 or covered < len(trainable) else None
    options = {k: v for k, v in groups[0].items() if k != "params"}

    def rebind(tensors: list[Any]) -> torch.optim.Optimizer:
        optimizer.param_groups.clear()
        optimizer.state.clear()
        if zero_groups is None:
            optimizer.add_param_group({**options, "params": list(tensors)})
        else:  # ZeRO's groups: the client's, in order, over its tensors, with the client's options
            for group in tensors:
                optimizer.add_param_group(group)
        return optimizer

    return rebind, zero_groups
