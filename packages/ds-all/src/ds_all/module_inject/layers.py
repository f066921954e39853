"""DeepSpeed's ``deepspeed.module_inject.layers``: AutoTP's column- and row-parallel layers (ds-parallel's
`LinearLayer` / `LinearAllreduce` at DeepSpeed's signatures) and the AutoTP mode.

The mode (DeepSpeed's ``set_autotp_mode`` / ``is_autotp_training_mode``) starts as inference;
``tp_model_init`` and an `initialize` whose ``tensor_parallel.autotp_size`` is above 0 switch it to training.
As in DeepSpeed, a layer built here in inference mode holds parameters that do not require gradients; in
training mode they keep the module's ``requires_grad``.

``tp_meta`` (a `tp_shard.AutoTPMeta`) sets the uneven split as DeepSpeed's does (by whole key/value heads);
``mp_group=None`` is the default process group (ds-parallel's convention; DeepSpeed: no tensor parallelism)."""

from __future__ import annotations

import enum
from typing import Any

from torch import nn

import ds_parallel

from .. import comm as dist
from .tp_shard import AutoTPMeta, get_shard_size_list

__all__ = ["AUTOTP_MODE", "LinearAllreduce", "LinearLayer", "get_auto_tp_mode", "is_autotp_training_mode",
           "set_autotp_mode"]


class AUTOTP_MODE(enum.Enum):  # DeepSpeed's name
    TRAINING = 1
    INFERENCE = 2


_MODE = AUTOTP_MODE.INFERENCE


def get_auto_tp_mode() -> AUTOTP_MODE:
    return _MODE


def is_autotp_training_mode() -> bool:
    return _MODE is AUTOTP_MODE.TRAINING


def set_autotp_mode(training: bool = False) -> None:
    """Training (True) or inference (False) mode for AutoTP layers built from now on."""
    global _MODE
    _MODE = AUTOTP_MODE.TRAINING if training else AUTOTP_MODE.INFERENCE


def _sizes(module: nn.Module, dim: int, mp_group: Any, kwargs: dict[str, Any], what: str) -> list[int] | None:
    """The shard sizes ``tp_meta`` asks for (None: ds-parallel's default split by the layer's name)."""
    meta = kwargs.get("tp_meta")
    unknown = sorted(set(kwargs) - {"name", "tp_meta"})
    if unknown:
        raise ValueError(f"{what}: unknown keyword argument(s) {', '.join(unknown)}; taken: name, tp_meta")
    if meta is None:
        return None
    if not isinstance(meta, AutoTPMeta):
        raise ValueError(f"{what}: tp_meta must be an AutoTPMeta, got {type(meta).__name__}")
    weight = module.weight  # nn.Linear: [out, in]; a Hugging Face Conv1D: [in, out]
    size = weight.shape[dim if isinstance(module, nn.Linear) else 1 - dim]
    return get_shard_size_list(size, dist.get_world_size(mp_group), meta, kwargs.get("name"))


def _inference_freeze(layer: nn.Module) -> None:
    if not is_autotp_training_mode():
        for param in (layer.weight, layer.bias):
            if param is not None:
                param.requires_grad_(False)


class LinearLayer(ds_parallel.LinearLayer):
    """DeepSpeed's ``LinearLayer(module, mp_group=None, skip_partition=False, gather_output=False, **kwargs)``
    (keywords ``name``, ``tp_meta``): ds-parallel's column-parallel layer."""

    def __init__(self, module: nn.Module, mp_group: Any = None, skip_partition: bool = False,
                 gather_output: bool = False, **kwargs: Any) -> None:
        sizes = _sizes(module, 0, mp_group, dict(kwargs), "LinearLayer")
        super().__init__(module, mp_group, skip_partition, gather_output, name=kwargs.get("name"),
                         partition_sizes=None if skip_partition else sizes)
        _inference_freeze(self)


class LinearAllreduce(ds_parallel.LinearAllreduce):
    """DeepSpeed's ``LinearAllreduce(module, mp_group, **kwargs)`` (keywords ``name``, ``tp_meta``):
    ds-parallel's row-parallel layer."""

    def __init__(self, module: nn.Module, mp_group: Any = None, **kwargs: Any) -> None:
        sizes = _sizes(module, 1, mp_group, dict(kwargs), "LinearAllreduce")
        super().__init__(module, mp_group, name=kwargs.get("name"), partition_sizes=sizes)
        _inference_freeze(self)
