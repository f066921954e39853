"""DeepSpeed's ``deepspeed.runtime.zero`` is ds-zero."""

from ds_zero import *  # noqa: F403
from ds_zero import __all__  # noqa: F401

from . import offload_config, partition_parameters, utils  # noqa: F401
