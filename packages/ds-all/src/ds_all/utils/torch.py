"""DeepSpeed's ``deepspeed.utils.torch``: torch-version checks for scripts and tests."""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion


def required_torch_version(min_version=None, max_version=None) -> bool:
    """True when the running torch is at least ``min_version`` and at most ``max_version`` (DeepSpeed's
    check: either bound may be omitted, not both)."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version needs min_version or max_version, got neither")
    running = TorchVersion(torch.__version__)
    if min_version is not None and running < str(min_version):
        return False
    return not (max_version is not None and running > str(max_version))


def register_grad_hook(param: torch.Tensor, hook):
    """Run ``hook(param)`` after ``param.grad`` has been accumulated (DeepSpeed's helper)."""
    return param.register_post_accumulate_grad_hook(hook)


__all__ = ["register_grad_hook", "required_torch_version"]
