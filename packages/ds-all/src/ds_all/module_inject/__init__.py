"""DeepSpeed's ``deepspeed.module_inject``: AutoTP's layers and shard sizes (``layers``, ``tp_shard``),
ds-parallel's under DeepSpeed's module paths, and the AutoTP mode switch."""

from . import layers, tp_shard  # noqa: F401
from .layers import get_auto_tp_mode, is_autotp_training_mode, set_autotp_mode

__all__ = ["get_auto_tp_mode", "is_autotp_training_mode", "set_autotp_mode"]
