"""DeepSpeed's ``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save``."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]

_CPU = torch.device("cpu")


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = _CPU) -> Any:
    """A copy of ``item`` (a tensor, or lists, tuples and dicts of them, nested) whose tensors are
    detached copies on ``device``, so that saving it stores no view of a larger buffer; anything else
    is returned as it is."""
    device = torch.device(device)
    if torch.is_tensor(item):
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
