"""DeepSpeed's ``deepspeed.runtime.activation_checkpointing``: its ``checkpointing`` is ``ds_all.checkpointing``."""

from . import checkpointing  # noqa: F401
