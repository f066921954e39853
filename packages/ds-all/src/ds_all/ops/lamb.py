# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.ops.lamb``."""

from ds_ops import FusedLamb

__all__ = ["FusedLamb"]
