# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr``: batches packed by
token count and the learning rate scaled per batch, ds-data's (`ds_data.batch_by_seqlens` & co). As in DeepSpeed
the engine does not act on ``data_sampling.dynamic_batching``: the script builds its loader and scheduler with
`get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed`, which reads the section."""

from ds_data import (
    VariableBatchSizeLR,
    batch_by_seqlens,
    dataloader_for_variable_batch_size,
    get_dataloader_and_lr_scheduler_for_variable_batch_size,
    get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed,
    lr_scheduler_for_variable_batch_size,
    scale_lr,
)

__all__ = ["VariableBatchSizeLR", "batch_by_seqlens", "dataloader_for_variable_batch_size",
           "get_dataloader_and_lr_scheduler_for_variable_batch_size",
           "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed",
           "lr_scheduler_for_variable_batch_size", "scale_lr"]
