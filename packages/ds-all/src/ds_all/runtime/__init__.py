"""DeepSpeed's ``deepspeed.runtime`` paths that scripts import, each an alias of the part that owns it."""

from . import activation_checkpointing, dataloader, engine, fp16, lr_schedules, pipe, utils, zero  # noqa: F401
