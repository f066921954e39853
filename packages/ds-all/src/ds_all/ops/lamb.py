"""DeepSpeed's ``deepspeed.ops.lamb``."""

from ds_ops import FusedLamb

__all__ = ["FusedLamb"]
