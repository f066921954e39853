"""DeepSpeed's ``deepspeed.runtime.fp16``: its ``loss_scaler`` module."""

from . import loss_scaler  # noqa: F401
