"""A 16-bit model without an fp16/bf16 section (``model.half()``, ``model.to(torch.bfloat16)``), trained as
DeepSpeed 0.19.8 trains it (measured on 2 ranks, see tests/test_half_model.py):

* ZeRO stages 1-3: as with the dtype's section enabled at its defaults: a float32 master copy of what
  the rank steps; float16 gets the fp16 section's dynamic loss scale (2^16 to start, hysteresis 2) and
  skips a step whose gradients overflowed; bfloat16 gets no loss scale and no overflow check
  (DeepSpeed's ``check_grad_overflow`` is off without a bf16 section).
* Stage 0: the optimizer steps the 16-bit parameters themselves (DeepSpeed hands the client's optimizer
  the model's parameters as they are): no master copy, no loss scale, no overflow check.
* Gradients are reduced in float32 (DeepSpeed's ``communication_data_type`` without an fp16/bf16
  section), unless ``communication_data_type`` says otherwise.
* Nothing else of the model is cast (DeepSpeed casts a model only for its fp16/bf16 section): frozen
  parameters and buffers keep their dtypes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import BF16Config, FP16Config, mixed_precision


def implied_precision(model: nn.Module, fp16: FP16Config, bf16: BF16Config,
                      communication_data_type: Any) -> tuple[FP16Config, BF16Config, Any, bool]:
    """The sections a model whose trainable parameters are all float16 (or all bfloat16) trains with when
    neither section is enabled, the communication dtype, and whether that is so (the implied sections; at
    stage 0 the optimizer steps the 16-bit parameters directly); the sections as given otherwise."""
    if mixed_precision(fp16, bf16) != "fp32":
        return fp16, bf16, communication_data_type, False
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if dtypes == {torch.float16}:
        fp16 = FP16Config.from_section_or_ds_config({"enabled": True})
    elif dtypes == {torch.bfloat16}:
        bf16 = BF16Config.from_section_or_ds_config({"enabled": True, "check_grad_overflow": False})
    else:
        return fp16, bf16, communication_data_type, False
    return fp16, bf16, "fp32" if communication_data_type is None else communication_data_type, True
