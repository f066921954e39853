"""DeepSpeed's ``deepspeed.runtime.lr_schedules`` is ``ds_all.lr_schedules``."""

from ..lr_schedules import *  # noqa: F403
from ..lr_schedules import __all__  # noqa: F401
