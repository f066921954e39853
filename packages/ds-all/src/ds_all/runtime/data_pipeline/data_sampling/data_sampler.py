# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling.data_sampler``: ``DeepSpeedDataSampler`` is
ds-data's `DataSampler` (its own signature: ``DataSampler(total_samples, num_epochs, micro_batch_size,
data_parallel_rank, data_parallel_size, ...)``, not DeepSpeed's data-efficiency config dict first)."""

from ds_data import DataSampler as DeepSpeedDataSampler

__all__ = ["DeepSpeedDataSampler"]
