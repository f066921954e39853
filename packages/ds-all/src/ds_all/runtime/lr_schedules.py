# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.lr_schedules`` is ``ds_all.lr_schedules``."""

from ..lr_schedules import *  # noqa: F403
from ..lr_schedules import __all__  # noqa: F401
