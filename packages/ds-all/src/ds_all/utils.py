"""DeepSpeed's ``deepspeed.utils``: ``logger``, ``log_dist``, ``RepeatingLoader``, ``set_random_seed``."""

from ._data import RepeatingLoader
from ._utils import log_dist, logger, set_random_seed

__all__ = ["RepeatingLoader", "log_dist", "logger", "set_random_seed"]
