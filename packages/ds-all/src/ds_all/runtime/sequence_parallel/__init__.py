# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.sequence_parallel``: ``parallel_state_sp``, the sequence-parallel mpu."""
