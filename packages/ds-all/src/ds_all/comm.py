"""DeepSpeed's ``deepspeed.comm`` is ds-comm: ``import ds_all.comm as dist``."""

from ds_comm import *  # noqa: F403  (the same public names)
from ds_comm import __all__  # noqa: F401
