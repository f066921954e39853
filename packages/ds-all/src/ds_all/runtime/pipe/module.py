"""DeepSpeed's ``deepspeed.runtime.pipe.module``."""

from ds_pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
