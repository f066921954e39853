"""A client's optimizer and ``model_parameters`` under ZeRO: ZeRO steps flat tensors of its own, so
the client's optimizer is rebound to them (its hyperparameters and the object kept, as DeepSpeed's
ZeRO rebinds the client optimizer's groups), and a schedule built on it keeps working."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _groups(model_parameters: Any) -> list[dict[str, Any]]:
    items = list(model_parameters)
    if items and all(isinstance(item, dict) for item in items):
        return [dict(item, params=list(item["params"])) for item in items]
    if all(isinstance(item, torch.Tensor) for item in items):
        return [{"params": items}]
    if all(isinstance(item, tuple) and len(item) == 2 for item in items):  # named_parameters()
        return [{"params": [p for _, p in items]}]
    raise ValueError("initialize: model_parameters must be parameters, (name, parameter) pairs or parameter "
                     f"groups (dicts with 'params'), got a list of {sorted({type(i).__name__ for i in items})}")


def _check_groups(groups: list[dict[str, Any]], trainable: list[torch.Tensor], what: str) -> None:
    given = {id(p) for group in groups for p in group["params"]}
    wanted = {id(p) for p in trainable}
    if given != wanted:
        raise ValueError(f"initialize: {what} hold {len(given & wanted)} of the model's {len(wanted)} trainable "
                         f"parameters and {len(given - wanted)} others; ZeRO optimizes exactly the trainable "
                         "parameters (requires_grad=True): freeze the others with requires_grad_(False)")
    options = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    if any(option != options[0] for option in options[1:]):
        raise NotImplementedError(f"initialize: {what} have {len(groups)} groups with different options "
                                  f"({options}); ds-all steps one group over ZeRO's flat buffers in this version: "
                                  "give every group the same options")


def check_model_parameters(model_parameters: Any, trainable: list[torch.Tensor]) -> None:
    """``model_parameters`` must be the model's trainable parameters, in groups of one set of options."""
    _check_groups(_groups(model_parameters), trainable, "model_parameters")


def rebinder(optimizer: torch.optim.Optimizer, trainable: list[torch.Tensor]) -> Callable:
    """A factory for `ds_zero.ZeroOptimizer` that rebinds ``optimizer`` (built by the client over the
    model's parameters, not stepped yet) to ZeRO's tensors, keeping its options and the object."""
    _check_groups(optimizer.param_groups, trainable, "the optimizer's parameter groups")
    if optimizer.state:
        raise ValueError("initialize: the optimizer has state already (it was stepped); pass a fresh optimizer")
    options = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}

    def rebind(tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        optimizer.param_groups.clear()
        optimizer.state.clear()
        optimizer.add_param_group({**options, "params": list(tensors)})
        return optimizer

    return rebind
