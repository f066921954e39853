# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.zero.utils``: its exception type."""

from ds_zero import ZeRORuntimeException

__all__ = ["ZeRORuntimeException"]
