"""The sections of a DeepSpeed config that belong to no package below ds-all: monitors, activation
checkpointing, checkpoints, data types, the pipeline's engine keys, and the optimizer entry."""

from __future__ import annotations

from typing import Any, Literal

from ds_config import Section
from pydantic import Field, field_validator


class TensorBoardConfig(Section):
    """``tensorboard``: scalars written with torch's SummaryWriter."""

    section = "tensorboard"

    enabled: bool = Field(False, description="Write TensorBoard event files.")
    output_path: str = Field("", description="Directory of the event files (empty: ./runs).")
    job_name: str = Field("DeepSpeedJobName", description="Sub-directory per job.")


class CSVMonitorConfig(Section):
    """``csv_monitor``: one CSV file per logged scalar."""

    section = "csv_monitor"

    enabled: bool = Field(False, description="Write CSV files.")
    output_path: str = Field("", description="Directory of the CSV files (empty: ./csv_monitor).")
    job_name: str = Field("DeepSpeedJobName", description="Sub-directory per job.")


class WandbConfig(Section):
    """``wandb``: Weights & Biases logging."""

    section = "wandb"

    enabled: bool = Field(False, description="Log to Weights & Biases.")
    group: str | None = Field(None, description="Run group.")
    team: str | None = Field(None, description="Team (entity).")
    project: str = Field("deepspeed", description="Project name.")


class ActivationCheckpointingConfig(Section):
    """``activation_checkpointing``: what `checkpointing.checkpoint` keeps and where."""

    section = "activation_checkpointing"

    partition_activations: bool = Field(False, description="Split checkpointed activations across "
                                        "model-parallel ranks.")
    cpu_checkpointing: bool = Field(False, description="Keep checkpointed activations on the CPU "
                                    "(needs partition_activations).")
    contiguous_memory_optimization: bool = Field(False, description="Copy checkpoints into one contiguous "
                                                 "buffer.")
    number_checkpoints: int | None = Field(None, gt=0, description="Checkpoints per forward (for the "
                                           "contiguous buffer).")
    synchronize_checkpoint_boundary: bool = Field(False, description="Synchronise the device at each "
                                                  "checkpoint boundary.")
    profile: bool = Field(False, description="Time the forward/recompute of each checkpoint.")


class ParallelWriteConfig(Section):
    pipeline_stage: bool = Field(False, description="Pipeline stages write their checkpoint parts in parallel.")


class CheckpointConfig(Section):
    """``checkpoint``: how checkpoints are tagged, loaded and written."""

    section = "checkpoint"

    tag_validation: str = Field("Warn", description="Ignore, Warn or Fail (any case) when ranks save under "
                                "different tags.")
    load_universal: bool = Field(False, description="Load a universal (world-size-free) checkpoint.")
    use_node_local_storage: bool = Field(False, description="Each node writes to its own storage.")
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig,
                                                description="Parallel checkpoint writes.")

    @field_validator("tag_validation")
    @classmethod
    def _tag_validation(cls, value: str) -> str:
        if value.lower() not in ("ignore", "warn", "fail"):
            raise ValueError(f"checkpoint.tag_validation must be Ignore, Warn or Fail, got {value!r}")
        return value.capitalize()


class DataTypesConfig(Section):
    """``data_types``: the dtype gradients accumulate in."""

    section = "data_types"

    grad_accum_dtype: Literal["fp32", "fp16", "bf16"] | None = Field(None, description="Gradient accumulation "
                                                                     "dtype (null: the model's).")
    param_dtype: str | None = Field(None, description="The parameters' dtype; must agree with fp16/bf16 (DeepSpeed "
                                    "0.19 checks it, the precision sections decide it).")
    buffer_dtype: str | None = Field(None, description="The buffers' dtype (DeepSpeed 0.19: buffers keep theirs "
                                     "unless this is set).")
    keep_in_fp32_modules: Literal["auto"] | list[str] = Field("auto", description="Name patterns of buffers kept "
                                                              "in float32.")

    @field_validator("param_dtype", "buffer_dtype")
    @classmethod
    def _dtype(cls, value: str | None, info) -> str | None:
        from ._runtime_config import dtype_name

        dtype_name(value, f"data_types.{info.field_name}")
        return value


# DeepSpeed's optimizer types (lower case, as DeepSpeed compares them); any torch.optim class by name too.
OPTIMIZERS = ("adam", "adamw", "lamb", "lion", "adagrad", "onebitadam", "zerooneadam", "onebitlamb",
              "muadam", "muadamw", "musgd")


class OptimizerConfig(Section):
    """``optimizer``: ``type`` (DeepSpeed's names, case-insensitive, or a ``torch.optim`` class name)
    and the constructor's ``params``."""

    section = "optimizer"

    type: str = Field(description="Adam, AdamW, Lamb, Lion, Adagrad, OneBitAdam, ZeroOneAdam, OneBitLamb, or "
                      "the name of a torch.optim optimizer.")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the optimizer.")

    @field_validator("type")
    @classmethod
    def _known(cls, value: str) -> str:
        import difflib

        import torch

        torch_names = [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                       and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"]
        if value.lower() in OPTIMIZERS or value in torch_names:
            return value
        known = ["Adam", "AdamW", "Lamb", "Lion", "Adagrad", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", *torch_names]
        close = difflib.get_close_matches(value, known, n=1, cutoff=0.6)
        raise ValueError(f"unknown optimizer type {value!r}{f'; did you mean {close[0]!r}?' if close else ''} "
                         f"Known: DeepSpeed's {', '.join(known[:8])} and torch.optim's {', '.join(torch_names)}")
