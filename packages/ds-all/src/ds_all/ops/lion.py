"""DeepSpeed's ``deepspeed.ops.lion``."""

from ds_ops import CPULion as DeepSpeedCPULion

__all__ = ["DeepSpeedCPULion"]
