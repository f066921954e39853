# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.ops.op_builder`` is ds-ops' builder (``CPUAdamBuilder().load()`` ...)."""

from ds_ops.op_builder import *  # noqa: F403
from ds_ops.op_builder import __all__  # noqa: F401
