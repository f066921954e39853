# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.accelerator``: ``from ds_all.accelerator import get_accelerator`` (ds-ops' seam)."""

from ds_ops import (
    SUPPORTED_ACCELERATOR_LIST,
    Accelerator,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

__all__ = ["SUPPORTED_ACCELERATOR_LIST", "Accelerator", "get_accelerator",
           "is_current_accelerator_supported", "set_accelerator"]
