"""DeepSpeed's ``deepspeed.runtime.pipe.topology``."""

from ds_comm import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from ds_pipe import PipelineParallelGrid

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid", "ProcessTopology"]
