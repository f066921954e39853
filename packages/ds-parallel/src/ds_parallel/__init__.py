"""ds-parallel: tensor- and sequence-parallel building blocks (see README.md)."""

__version__ = "0.1.0"

from ._autotp import replace_module_consolidated_state_dict, tp_model_init
from ._autotp_layers import LinearAllreduce, LinearLayer
from ._autotp_specs import AutoTPConfig, TPLayerSpec, apply_partition_config
from ._cross_entropy import vocab_parallel_cross_entropy
from ._fpdt import fpdt_token_order
from ._layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    param_is_not_tensor_parallel_duplicate,
    set_tensor_model_parallel_attributes,
    vocab_range_from_global_vocab_size,
)
from ._mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from ._mpu import ModelParallelUnit
from ._random import CudaRNGStatesTracker, get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from ._sequence_cross_entropy import vocab_sequence_parallel_cross_entropy
from ._shard import get_shard_size, get_shard_size_list
from ._ulysses import DistributedAttention, SeqAllToAll, seq_all_to_all

__all__: list[str] = [
    "AutoTPConfig",
    "ColumnParallelLinear",
    "CudaRNGStatesTracker",
    "DistributedAttention",
    "LinearAllreduce",
    "LinearLayer",
    "ModelParallelUnit",
    "RowParallelLinear",
    "SeqAllToAll",
    "TPLayerSpec",
    "VocabParallelEmbedding",
    "__version__",
    "apply_partition_config",
    "copy_to_tensor_model_parallel_region",
    "fpdt_token_order",
    "gather_from_tensor_model_parallel_region",
    "get_cuda_rng_tracker",
    "get_shard_size",
    "get_shard_size_list",
    "model_parallel_cuda_manual_seed",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_from_tensor_model_parallel_region",
    "replace_module_consolidated_state_dict",
    "scatter_to_tensor_model_parallel_region",
    "seq_all_to_all",
    "set_tensor_model_parallel_attributes",
    "tp_model_init",
    "vocab_parallel_cross_entropy",
    "vocab_range_from_global_vocab_size",
    "vocab_sequence_parallel_cross_entropy",
]
