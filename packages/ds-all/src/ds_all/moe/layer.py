# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.moe.layer``: ds-moe's `MoE`."""

from ds_moe import MoE

__all__ = ["MoE"]
