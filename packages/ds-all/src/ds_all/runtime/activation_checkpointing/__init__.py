# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.activation_checkpointing``: its ``checkpointing`` is ``ds_all.checkpointing``."""

from . import checkpointing  # noqa: F401
