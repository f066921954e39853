# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.pipe``: ds-pipe's modules and ds-comm's topologies."""

from ds_comm import ProcessTopology
from ds_pipe import LayerSpec, PipelineModule, TiedLayerSpec

from . import engine, module, schedule, topology  # noqa: F401

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
