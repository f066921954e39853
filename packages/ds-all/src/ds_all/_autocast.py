"""``torch_autocast`` as a part of the engine, built from its section, its dtype, the engine's device type and the
ZeRO stage: ``context()`` is the forward's context (``torch.autocast`` with the section's dtype when it is enabled,
else a null context). The class names it in ``lower_precision_safe_modules`` are checked importable, as DeepSpeed
checks them.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Autocast:
    """The forward's autocast context (see the module docstring)."""

    def __init__(self, section: Any, *, dtype: torch.dtype | None, device_type: str, zero_stage: int) -> None:
        self.context: Callable[[], Any] = contextlib.nullcontext
        if not section.enabled:
            return
        for name in section.lower_precision_safe_modules or ():  # named as DeepSpeed checks them: importable
            package, _, attribute = name.rpartition(".")
            try:
                getattr(importlib.import_module(package), attribute)
            except (ImportError, AttributeError, ValueError) as e:
                raise ValueError(f"torch_autocast.lower_precision_safe_modules: cannot import {name!r} ({e})") from None
        if dtype == torch.float16 and zero_stage == 0:
            raise NotImplementedError("torch_autocast with dtype fp16 at zero_optimization.stage 0 needs DeepSpeed's "
                                      "torch GradScaler, not built in ds-all; use bf16, or a ZeRO stage 1-3")
        self.context = lambda: torch.autocast(device_type=device_type, dtype=dtype, enabled=True)

    @staticmethod
    def pipeline_refusal(config: Any, module: nn.Module) -> Exception | None:
        """Why a `PipelineEngine` cannot train ``module`` with this part (None: it can)."""
        if not config.torch_autocast.enabled:
            return None
        return NotImplementedError("torch_autocast with a PipelineModule is not implemented in ds-all: the schedule "
                                   "runs the forward; use bf16 or fp16 (the bf16/fp16 sections)")
