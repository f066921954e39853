"""DeepSpeed's ``deepspeed.comm`` is ds-comm: ``import ds_all.comm as dist``; with DeepSpeed's
``get_world_group`` and ``initialize_mesh_device`` besides."""

from __future__ import annotations

from typing import Any

import torch.distributed

from ds_comm import *  # noqa: F403  (the same public names)
from ds_comm import __all__ as _ds_comm_all
from ds_comm import is_initialized as _is_initialized

__all__ = [*_ds_comm_all, "get_world_group", "initialize_mesh_device"]


def get_world_group() -> Any:
    """The default process group (every rank)."""
    if not _is_initialized():
        raise RuntimeError("get_world_group: no process group yet; call ds_all.comm.init_distributed() first")
    return torch.distributed.group.WORLD


def initialize_mesh_device(mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]) -> Any:
    """A torch ``DeviceMesh`` of ``mesh_shape`` over every rank, its dimensions named ``mesh_dim_names``, on the
    accelerator's device type (``cpu`` on the CPU, gloo)."""
    if not _is_initialized():
        raise RuntimeError("initialize_mesh_device: no process group yet; call ds_all.comm.init_distributed() first")
    shape, names = tuple(mesh_shape), tuple(mesh_dim_names)
    if len(shape) != len(names) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape):
        raise ValueError(f"initialize_mesh_device: mesh_shape must be positive integers, one per name of "
                         f"{names}, got {mesh_shape!r}")
    world = torch.distributed.get_world_size()
    total = 1
    for n in shape:
        total *= n
    if total != world:
        raise ValueError(f"initialize_mesh_device: mesh_shape {shape} covers {total} ranks, the world has {world}")
    from torch.distributed.device_mesh import init_device_mesh

    from .accelerator import get_accelerator

    return init_device_mesh(get_accelerator().device_name(), shape, mesh_dim_names=names)
