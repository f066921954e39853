"""DeepSpeed's ``deepspeed.runtime.pipe.engine``."""

from ..._pipe_engine import PipelineEngine

__all__ = ["PipelineEngine"]
