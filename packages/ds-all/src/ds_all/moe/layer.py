"""DeepSpeed's ``deepspeed.moe.layer``: ds-moe's `MoE`."""

from ds_moe import MoE

__all__ = ["MoE"]
