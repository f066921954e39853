# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.pipe.topology``."""

from ds_comm import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from ds_pipe import PipelineParallelGrid

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid",
           "ProcessTopology"]
