# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.ops.adagrad``."""

from ds_ops import CPUAdagrad as DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
