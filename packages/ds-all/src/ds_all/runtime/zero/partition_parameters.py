"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters``: ds-zero's `Init`, `GatheredParameters`,
external parameters and `ZeroParamStatus` (the ``ds_status`` of a ZeRO-3 parameter); and the tensor-constructor
wrapper Transformers swaps while it builds a model under ZeRO-3.

Transformers' ``prevent_arange_dtype_change`` replaces ``zero_wrapper_for_fp_tensor_constructor`` for the time of
``from_config``/``from_pretrained`` and compares the wrapped function with ``_orig_torch_arange``. ds-zero's
``Init`` does not route tensor constructors through this wrapper (it makes a model's tensors in the 16-bit dtype
through the default dtype, so an explicit ``dtype=`` of ``torch.arange`` is kept anyway): replacing it changes
nothing here, and the names exist so that such code runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ds_zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

from ...accelerator import get_accelerator

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "get_accelerator", "register_external_parameter",
           "unregister_external_parameter", "zero_wrapper_for_fp_tensor_constructor"]

_orig_torch_arange = torch.arange  # DeepSpeed's name for the unwrapped constructor


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype,
                                           target_device: Any = None) -> Callable:
    """``fn`` (a tensor constructor such as ``torch.empty``) whose floating-point results are cast to
    ``target_fp_dtype``, made on ``target_device`` unless a ``device=`` is given (DeepSpeed's signature)."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped
