# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.module_inject``: AutoTP's layers and shard sizes (``layers``, ``tp_shard``),
ds-parallel's under DeepSpeed's module paths, and the AutoTP mode switch."""

from . import layers, tp_shard  # noqa: F401
from .layers import get_auto_tp_mode, is_autotp_training_mode, set_autotp_mode

__all__ = ["get_auto_tp_mode", "is_autotp_training_mode", "set_autotp_mode"]
