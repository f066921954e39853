"""Where the engine trains: DeepSpeed's ``_set_distributed_vars`` (the device of ``LOCAL_RANK``, made the
current one) and the model's move in ``_configure_distributed_model``, through ds-ops' accelerator seam.

With the CUDA accelerator (``ds_ops.get_accelerator()``: a visible GPU, or ``DS_ACCELERATOR=cuda``) the
engine's device is ``cuda:<LOCAL_RANK>`` and `initialize` moves the model there; with the CPU accelerator
it is the CPU and nothing moves. A CPU test exercises the choice with a stand-in accelerator.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

import ds_ops

logger = logging.getLogger("ds_all")


def engine_device(local_rank: int, accelerator: Any = None) -> torch.device:
    """The device of the engine of the process with ``local_rank``: the CPU with the CPU accelerator;
    with a GPU accelerator its device ``local_rank`` (modulo the GPUs visible, as `ds_comm.init_distributed`
    picks it), made the current device (DeepSpeed's ``get_accelerator().set_device(local_rank)``)."""
    accelerator = ds_ops.get_accelerator() if accelerator is None else accelerator
    if accelerator.device_name() == "cpu":
        return torch.device("cpu")
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
        raise ValueError(f"engine device: LOCAL_RANK must be an integer >= 0, got {local_rank!r}")
    index = local_rank % max(accelerator.device_count(), 1)
    accelerator.set_device(index)
    return torch.device(accelerator.device_name(index))


def is_partitioned(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are partitioned by ZeRO-3 (built under ``ds_zero.Init``): each holds
    only its shard (``ds_tensor``), which ZeRO places; DeepSpeed's ``is_zero_init_model``."""
    return any(hasattr(p, "ds_tensor") for p in model.parameters())


def place_model(model: nn.Module, device: torch.device) -> bool:
    """Move ``model`` to ``device`` as DeepSpeed's engine does at initialize (parameters and buffers, the
    same ``Parameter`` objects, so an optimizer built over them still holds them), unless ZeRO-3
    partitioned it under ``ds_zero.Init`` (its shards are placed by ZeRO). Returns whether it moved."""
    if is_partitioned(model):
        return False
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.device == device for t in tensors):
        return False
    model.to(device)
    logger.debug("initialize: the model moved to %s", device)
    return True
