"""DeepSpeed's ``deepspeed.moe.experts``: ds-moe's `Experts`."""

from ds_moe import Experts

__all__ = ["Experts"]
