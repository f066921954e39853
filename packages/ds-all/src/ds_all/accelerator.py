"""DeepSpeed's ``deepspeed.accelerator``: ``from ds_all.accelerator import get_accelerator`` (ds-ops' seam)."""

from ds_ops import Accelerator, get_accelerator, set_accelerator

__all__ = ["Accelerator", "get_accelerator", "set_accelerator"]
