"""DeepSpeed's ``deepspeed.runtime.pipe.topology``."""

from ds_comm import Grid as PipelineParallelGrid
from ds_comm import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid", "ProcessTopology"]
