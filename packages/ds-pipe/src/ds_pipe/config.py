"""``PipelineConfig``: the ``pipeline`` section of a DeepSpeed config, key for key, plus ds's schedule keys."""

from __future__ import annotations

from typing import Literal

from ds_config import Section
from pydantic import Field

SECTION = "pipeline"


class PipelineConfig(Section):
    """``pipeline``: how a `PipelineModule` is cut and scheduled. DeepSpeed's keys with its defaults;
    ``schedule`` and ``virtual_stages`` are ds's (DeepSpeed runs 1F1B only)."""

    section = SECTION

    stages: int | Literal["auto"] = Field("auto", description="Pipeline stages (auto: from the PipelineModule).")
    partition: str = Field("best", description="How layers are split between stages: parameters, uniform, "
                           "type:<regex> (DeepSpeed's 'best' is read as parameters).")
    seed_layers: bool = Field(False, description="Seed each layer's initialisation with base_seed + its index.")
    activation_checkpoint_interval: int = Field(0, ge=0, description="Checkpoint activations every this many "
                                                "layers (0: off).")
    pipe_partitioned: bool = Field(True, description="With tensor-parallel stages: each tensor-parallel rank "
                                   "sends its 1/tp part of the activation between stages, the next stage "
                                   "all-gathers it (no effect without tensor parallelism).")
    grad_partitioned: bool = Field(True, description="Split the gradients sent back between stages likewise.")
    schedule: Literal["1f1b", "interleaved", "zero_bubble"] = Field(
        "1f1b", description="ds: the training schedule: 1f1b (DeepSpeed's), interleaved (virtual_stages chunks "
        "per rank), zero_bubble (ZB-H1: weight gradients fill the bubble).")
    use_reentrant: bool | None = Field(None, description="Activation checkpointing with torch's reentrant "
                                       "variant (DeepSpeed's default, null: true); ds-pipe always uses the "
                                       "non-reentrant one, which gives the same gradients.")
    virtual_stages: int = Field(1, ge=1, description="ds: model chunks per rank for the interleaved schedule.")

    def partition_method(self) -> str:
        """The PipelineModule ``partition_method`` this section names."""
        return "parameters" if self.partition == "best" else self.partition
