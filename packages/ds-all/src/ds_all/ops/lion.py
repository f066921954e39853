# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.ops.lion``."""

from ds_ops import CPULion as DeepSpeedCPULion

__all__ = ["DeepSpeedCPULion"]
