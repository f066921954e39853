# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.autotuning.utils``: ``get_val_by_key`` and ``set_val_by_key`` (a key at any depth
of a nested config), ds-autotune's."""

from ds_autotune import get_val_by_key, set_val_by_key

__all__ = ["get_val_by_key", "set_val_by_key"]
