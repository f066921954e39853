"""DeepSpeed's ``deepspeed.ops.adam``."""

from ds_ops import CPUAdam as DeepSpeedCPUAdam
from ds_ops import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
