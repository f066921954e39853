"""DeepSpeed's ``deepspeed.zero`` is ds-zero: ``ds_all.zero.Init``, ``GatheredParameters``, ..."""

from ds_zero import *  # noqa: F403  (the same public names)
from ds_zero import __all__  # noqa: F401
