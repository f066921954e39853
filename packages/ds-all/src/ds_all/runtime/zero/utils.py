"""DeepSpeed's ``deepspeed.runtime.zero.utils``: its exception type."""

from ds_zero import ZeRORuntimeException

__all__ = ["ZeRORuntimeException"]
