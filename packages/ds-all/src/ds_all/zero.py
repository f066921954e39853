# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.zero`` is ds-zero: ``ds_all.zero.Init``, ``GatheredParameters``, ..."""

from ds_zero import *  # noqa: F403
from ds_zero import __all__  # noqa: F401
