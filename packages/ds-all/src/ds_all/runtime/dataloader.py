"""DeepSpeed's ``deepspeed.runtime.dataloader``."""

from .._data import RepeatingLoader

__all__ = ["RepeatingLoader"]
