# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.moe.experts``: ds-moe's `Experts`."""

from ds_moe import Experts

__all__ = ["Experts"]
