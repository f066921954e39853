# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.pipe.engine``."""

from ..._pipe_engine import PipelineEngine

__all__ = ["PipelineEngine"]
