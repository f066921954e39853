# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.fp16``: its ``loss_scaler`` module."""

from . import loss_scaler  # noqa: F401
