"""DeepSpeed's ``deepspeed.runtime.sequence_parallel``: ``parallel_state_sp``, the sequence-parallel mpu."""
