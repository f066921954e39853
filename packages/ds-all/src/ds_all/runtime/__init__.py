# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime`` paths that scripts import, each an alias of the part that owns it."""

from . import (  # noqa: F401
    activation_checkpointing,
    bf16_optimizer,
    data_pipeline,
    dataloader,
    engine,
    fp16,
    lr_schedules,
    pipe,
    progressive_layer_drop,
    utils,
    zero,
)
