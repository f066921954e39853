"""ds-comm: what every distributed part of ds talks through.

torch.distributed-shaped collectives (checked, with gloo fallbacks), bucketed collectives over
caller-owned flat buffers (`reduce_scatter_bucket`, `all_gather_bucket`), process-group life with
launcher/MPI/SLURM discovery and a clean exit, the comms logger (config section ``comms_logger``) with hang
diagnosis, 3D topology and the ``mpu``, the node layout (`node_topology`), 1-bit compressed all-reduce, ZeRO++'s
quantized all-gather and hierarchical reduce-scatter, and `ds_comm.testing`.
"""

__version__ = "0.1.0"

from .collectives import (
    P2POp,
    ReduceOp,
    all_gather,
    all_gather_bucket,
    all_gather_into_tensor,
    all_reduce,
    all_reduce_coalesced,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    inference_all_reduce,
    irecv,
    isend,
    monitored_barrier,
    recv,
    reduce,
    reduce_scatter_bucket,
    reduce_scatter_tensor,
    send,
)
from .compressed import compressed_allreduce, error_buffer_sizes, pack_signs, unpack_signs
from .config import CommsLoggerConfig
from .distributed import (
    destroy_process_group,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    new_group,
)
from .logger import CollectiveHang, comms_logger
from .quantized import quantized_all_gather, quantized_reduce_scatter
from .topology import (
    Grid,
    HierarchicalGroups,
    NodeTopology,
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    node_topology,
)


def configure(config=None, **overrides) -> CommsLoggerConfig:
    """Set the comms logger from a ``comms_logger`` section (dict, or a whole DeepSpeed config
    dict, or `CommsLoggerConfig`), with keyword overrides: ``configure(enabled=True)``."""
    return comms_logger.configure(config, **overrides)


def log_summary(show_straggler: bool = False) -> list[dict]:
    """Log the per-op summary on rank 0 and return it as records (see `CommsLogger.log_summary`)."""
    return comms_logger.log_summary(show_straggler=show_straggler)


__all__ = [
    "CollectiveHang", "CommsLoggerConfig", "Grid", "HierarchicalGroups", "NodeTopology", "P2POp", "PipeDataParallelTopology",
    "PipeModelDataParallelTopology", "ProcessTopology", "ReduceOp", "__version__",
    "all_gather", "all_gather_bucket", "all_gather_into_tensor", "all_reduce", "all_reduce_coalesced",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "comms_logger", "compressed_allreduce", "configure", "destroy_process_group",
    "error_buffer_sizes", "get_global_rank", "get_local_rank", "get_rank", "get_world_size", "inference_all_reduce",
    "init_distributed",
    "irecv", "is_initialized", "isend", "log_summary", "monitored_barrier", "new_group", "node_topology", "pack_signs",
    "quantized_all_gather", "quantized_reduce_scatter", "recv",
    "reduce", "reduce_scatter_bucket", "reduce_scatter_tensor", "send", "unpack_signs",
]
