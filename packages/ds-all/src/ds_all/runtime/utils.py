"""DeepSpeed's ``deepspeed.runtime.utils``."""

from __future__ import annotations

import torch

from .._utils import set_random_seed

__all__ = ["is_model_parallel_parameter", "set_random_seed"]


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    """Whether ``p`` is split over the model-parallel ranks: it carries Megatron's ``tensor_model_parallel``
    mark (ds-parallel's layers and AutoTP set it) or an older ``model_parallel`` one, true."""
    return bool(getattr(p, "model_parallel", False)) or bool(getattr(p, "tensor_model_parallel", False))
