# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.ops.adam``."""

from ds_ops import CPUAdam as DeepSpeedCPUAdam
from ds_ops import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
