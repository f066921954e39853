"""DeepSpeed's ``deepspeed.ops.adagrad``."""

from ds_ops import CPUAdagrad as DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
