"""DeepSpeed's ``deepspeed.utils``: ``logger``, ``log_dist``, ``RepeatingLoader``, ``set_random_seed``, and the
``groups`` module (the process groups of each kind of parallelism)."""

from .._data import RepeatingLoader
from .._utils import log_dist, logger, set_random_seed
from . import groups  # noqa: F401  (deepspeed.utils.groups)

__all__ = ["RepeatingLoader", "log_dist", "logger", "set_random_seed"]
