# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.pipe.module``."""

from ds_pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
