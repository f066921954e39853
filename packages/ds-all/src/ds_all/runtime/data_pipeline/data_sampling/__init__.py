# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling``: ds-data's analyzer, sampler and indexed
dataset at its paths; ``variable_batch_size_and_lr`` is not wired into ds-all yet (an ImportError naming it)."""
