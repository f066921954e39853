# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.engine``."""

from .._engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
