"""DeepSpeed's ``deepspeed.runtime.utils``."""

from .._utils import set_random_seed

__all__ = ["set_random_seed"]
