"""Where a pipeline stage lives, and where its messages travel.

A stage's layers, activations and gradients live on the stage's device: DeepSpeed's
``get_accelerator().device_name(LOCAL_RANK)``, through ds-ops' accelerator seam (``cuda:<LOCAL_RANK>``
with a GPU, the CPU otherwise). Its messages travel through the backend of the executor's group: NCCL
moves device tensors only (so headers and shapes go on the device too), gloo moves host memory only
(so a GPU stage on gloo sends through CPU copies). On the CPU both are the CPU and nothing is copied.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import ds_comm
import ds_ops


def stage_device(accelerator: Any = None) -> torch.device:
    """This process's stage device: the CPU with the CPU accelerator, else the accelerator's device of
    ``LOCAL_RANK`` (modulo the devices visible, as `ds_comm.init_distributed` makes it current)."""
    accelerator = ds_ops.get_accelerator() if accelerator is None else accelerator
    if accelerator.device_name() == "cpu":
        return torch.device("cpu")
    index = ds_comm.get_local_rank() % max(accelerator.device_count(), 1)
    return torch.device(accelerator.device_name(index))


def module_device(module: torch.nn.Module, accelerator: Any = None) -> torch.device:
    """The device of ``module``'s first parameter or buffer (a stage without any: `stage_device`)."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return stage_device(accelerator)


def backend_of(group: Any, device: torch.device) -> str:
    """The name of the backend that moves ``device``'s tensors in ``group`` (one of "cpu:gloo,cuda:nccl")."""
    backend = str(dist.get_backend(group))
    if ":" not in backend:
        return backend
    pairs = dict(part.split(":", 1) for part in backend.split(","))
    return pairs.get(device.type, backend)


def wire_device(device: torch.device, backend: str) -> torch.device:
    """Where the messages of a stage on ``device`` travel through ``backend``: the device itself, except
    through gloo, which moves host memory only (a GPU stage over gloo sends and receives CPU copies)."""
    if device.type == "cpu" or backend == "gloo":
        return torch.device("cpu")
    return device
