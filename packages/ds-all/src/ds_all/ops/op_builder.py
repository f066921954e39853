"""DeepSpeed's ``deepspeed.ops.op_builder`` is ds-ops' builder (``CPUAdamBuilder().load()`` ...)."""

from ds_ops.op_builder import *  # noqa: F403
from ds_ops.op_builder import __all__  # noqa: F401
