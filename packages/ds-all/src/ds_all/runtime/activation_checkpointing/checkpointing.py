"""DeepSpeed's ``deepspeed.runtime.activation_checkpointing.checkpointing`` is ``ds_all.checkpointing``."""

from ...checkpointing import (  # noqa: F401
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    reset,
)
