"""`Config`: one strict model of a whole DeepSpeed config, composed of every package's section model.

    config = ds_all.Config.load("ds_config.json")          # or a dict
    config = config.resolve(dp_world_size=2)                # the batch triad filled in, no "auto" left
    config.zero_optimization.stage, config.train_micro_batch_size_per_gpu

Each section is the model of the package that owns it (``zero_optimization``/``fp16``/``bf16``:
ds-zero, ``comms_logger``: ds-comm, ``aio``: ds-io, ...); the top-level keys are ds-all's. A key
nobody knows is an error with a did-you-mean (DeepSpeed ignores it). DeepSpeed features ds-all does
not implement are accepted while disabled and refused, by name, when enabled.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from ds_config import ConfigError, Section, load_ds_config
from pydantic import Field, field_validator, model_validator

from ds_comm import CommsLoggerConfig
from ds_compress import CompressionConfig
from ds_data import CurriculumLearningConfig, DataEfficiencyConfig, ProgressiveLayerDropConfig
from ds_io import AioConfig
from ds_ops import SparseAttentionConfig
from ds_pipe import PipelineConfig
from ds_profiler import FlopsProfilerConfig
from ds_zero import BF16Config, FP16Config, ZeroConfig

from ._autotuning import AutotuningConfig
from ._elasticity import ElasticityConfig, elastic_batch_triad
from ._monitor_config import (
    ActivationCheckpointingConfig,
    CheckpointConfig,
    CSVMonitorConfig,
    DataTypesConfig,
    OptimizerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from ._runtime_config import CompileConfig, TensorParallelConfig, TorchAutocastConfig, dtype_name
from ._scheduler_config import SchedulerConfig

Auto = Literal["auto"]
Batch = Annotated[int, Field(gt=0)] | Auto | None

# DeepSpeed features ds-all does not implement: accepted while off, refused by name when on.
NOT_IMPLEMENTED = ("amp", "eigenvalue", "hybrid_engine", "nebula", "comet", "quantize_training", "weight_quantization",
                   "graph_harvesting", "memory_breakdown", "sparse_gradients", "load_universal_checkpoint",
                   "use_node_local_storage", "zero_quantized_weights", "zero_quantized_gradients",
                   "timers", "disable_allgather", "expert_parallel",
                   "datastates_ckpt")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


# "auto" values that are settings of their own, not placeholders for the caller to fill in.
MEANINGFUL_AUTO = ("pipeline.stages", "data_types.keep_in_fp32_modules", "zero_optimization.zenflow.select_strategy",
                   "zero_optimization.zenflow.select_interval", "zero_optimization.zenflow.update_interval")


def _enabled(value: Any) -> bool:
    if isinstance(value, Mapping):
        return bool(value.get("enabled", bool(value)))
    return value not in (None, False, 0, "", "none", "None")


class Config(Section):
    """A whole DeepSpeed config (see the module docstring). Build it with `Config.load`."""

    train_batch_size: Batch = Field(None, description="Samples per optimizer step over all data-parallel ranks.")
    train_micro_batch_size_per_gpu: Batch = Field(None, description="Samples per forward/backward per rank.")
    gradient_accumulation_steps: Batch = Field(None, description="Micro-steps per optimizer step.")
    optimizer: OptimizerConfig | None = Field(None, description="The optimizer built by initialize().")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="The learning-rate schedule "
                                       "built by initialize().")
    gradient_clipping: float = Field(1.0, ge=0.0, description="Maximum global gradient norm (0: off); "
                                     "DeepSpeed 0.19's default, 1.0, clips when the key is absent.")
    steps_per_print: int = Field(10, gt=0, description="Print progress every this many optimizer steps (inf, "
                                 "which Accelerate writes: never).")
    wall_clock_breakdown: bool = Field(False, description="Time forward, backward, step and reductions.")
    dump_state: bool = Field(False, description="Print the engine's state after initialisation.")
    prescale_gradients: bool = Field(False, description="Divide gradients before the reduction instead of after.")
    gradient_predivide_factor: float = Field(1.0, gt=0.0, description="Divide gradients by this before the "
                                             "reduction (and by world_size / it after).")
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = Field(
        None, description="The dtype gradients are reduced in (null: by precision).")
    zero_allow_untested_optimizer: bool = Field(False, description="Allow an optimizer ZeRO does not know.")
    zero_force_ds_cpu_optimizer: bool = Field(True, description="With CPU offload, use ds-ops' CPU Adam.")
    dataloader_drop_last: bool = Field(False, description="Drop the last incomplete batch of deepspeed_io.")
    seed: int | None = Field(None, description="Seed of torch, random and numpy set by initialize().")
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig, description="ds-zero's section.")
    fp16: FP16Config = Field(default_factory=FP16Config, description="ds-zero's fp16 section.")
    bf16: BF16Config = Field(default_factory=BF16Config, description="ds-zero's bf16 section.")
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig, description="ds-comm's section.")
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig, description="ds-profiler's.")
    aio: AioConfig = Field(default_factory=AioConfig, description="ds-io's section.")
    compression_training: CompressionConfig = Field(default_factory=CompressionConfig, description="ds-compress's.")
    sparse_attention: SparseAttentionConfig | None = Field(None, description="ds-ops' section.")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="Pipeline keys (ds_pipe).")
    curriculum_learning: CurriculumLearningConfig = Field(
        default_factory=CurriculumLearningConfig, description="ds-data's sequence-length curriculum (the engine "
        "passes curriculum_seqlen to forward).")
    progressive_layer_drop: ProgressiveLayerDropConfig = Field(
        default_factory=ProgressiveLayerDropConfig, description="ds-data's progressive layer dropping (the engine "
        "passes pld_theta to forward).")
    data_efficiency: DataEfficiencyConfig = Field(
        default_factory=DataEfficiencyConfig, description="ds-data's data efficiency library (random-LTD; data "
        "sampling is refused when on).")
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig, description="TensorBoard monitor.")
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig, description="CSV monitor.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases monitor.")
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig, description="Activation checkpointing.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoint options.")
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig, description="Data types.")
    gradient_allreduce_op: str = Field("mean", description="How data-parallel gradients combine: \"mean\" "
                                       "(DeepSpeed's default) or \"sum\" (refused: not built).")
    disable_python_gc: bool = Field(False, description="Disable Python's cyclic garbage collector while the "
                                    "engine lives (engine.collect_python_gc() runs it).")
    managed_gradient_accumulation: bool = Field(True, description="The engine accumulates gradients over "
                                                "micro-steps (false, the caller's own accumulation, is refused).")
    log_level: str | None = Field(None, description="Level of the \"DeepSpeed\" logger and ds's loggers: "
                                  "debug, info, warning, error or critical.")
    data_parallel_size: int | None = Field(None, ge=1, description="Data-parallel ranks (with "
                                           "sequence_parallel_size: their product is the world size).")
    sequence_parallel_size: int | None = Field(None, ge=1, description="Sequence-parallel ranks (Ulysses: "
                                               "initialize builds the sequence and sequence × data groups).")
    seq_parallel_communication_data_type: Literal["fp32", "fp16", "bf16"] = Field(
        "fp32", description="With sequence_parallel_size above 1: the dtype ZeRO reduces gradients in (DeepSpeed's).")
    use_data_before_expert_parallelism: bool = Field(False, description="The order of the data- and "
                                                     "expert-parallel groups (MoE).")
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig, description="The forward "
                                                "under torch.autocast.")
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig, description="AutoTP "
                                                  "(initialize slices the model with ds-parallel).")
    compile: CompileConfig = Field(default_factory=CompileConfig, description="DeepCompile (refused when on).")
    elasticity: ElasticityConfig = Field(default_factory=ElasticityConfig, description="Elastic training: when "
                                         "enabled, Config.resolve takes the batch triad from it.")
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig, description="An autotuning "
                                         "experiment (ds-autotune): when enabled the engine profiles and exits.")

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _never(cls, value: Any) -> Any:
        # Accelerate writes float("inf") to silence DeepSpeed's progress lines: no step is a multiple of it
        return sys.maxsize if isinstance(value, float) and value == math.inf else value

    @field_validator("gradient_allreduce_op", "log_level")
    @classmethod
    def _lower_case_choice(cls, value: str | None, info) -> str | None:
        allowed = ("mean", "sum") if info.field_name == "gradient_allreduce_op" else LOG_LEVELS
        if value is None:
            return None
        if value.lower() not in allowed:  # DeepSpeed compares lower-cased
            raise ValueError(f"{info.field_name} must be one of {', '.join(repr(a) for a in allowed)} (any case), "
                             f"got {value!r}")
        return value.lower()

    @model_validator(mode="before")
    @classmethod
    def _not_implemented(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = dict(data)
        if "bfloat16" in out:  # DeepSpeed's old name of the bf16 section
            if "bf16" in out:
                raise ValueError("give bf16 or bfloat16 (its old name), not both")
            logging.getLogger(__name__).warning("bfloat16 is the old name of the bf16 section; read as bf16")
            out["bf16"] = out.pop("bfloat16")
        for key in NOT_IMPLEMENTED:
            if key in out:
                value = out.pop(key)
                if _enabled(value):
                    from ._version import DS_VERSION

                    raise ValueError(f"{key} is a DeepSpeed feature ds-all {DS_VERSION} does not implement; remove "
                                     f"the key or disable it (got {value!r})")
        return out

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if self.fp16.enabled is True and self.bf16.enabled is True:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable one of them")
        self._refuse_what_is_not_built()
        stage = self.zero_optimization.stage
        if self.torch_autocast.enabled and self.zero_optimization.zero_quantized_weights:  # DeepSpeed's assert
            raise ValueError("torch_autocast.enabled and zero_optimization.zero_quantized_weights are both true: "
                             "DeepSpeed cannot enable both torch autocast and zero quantized weights; turn one off")
        if self.bf16.bf16_master_weights_and_grads and stage == 0:
            raise ValueError("bf16.bf16_master_weights_and_grads needs zero_optimization.stage 1, 2 or 3 (as in "
                             "DeepSpeed), got 0")
        if self.data_types.param_dtype is not None and self.fp16.enabled != "auto" and self.bf16.enabled != "auto":
            model = "float16" if self.fp16.enabled else "bfloat16" if self.bf16.enabled else "float32"
            if dtype_name(self.data_types.param_dtype, "data_types.param_dtype") != model:
                raise ValueError(f"data_types.param_dtype {self.data_types.param_dtype!r} conflicts with the "
                                 f"precision fp16/bf16 choose ({model}); set the matching enabled flag or omit it")
        triad = (self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps)
        if all(isinstance(v, int) for v in triad) and triad[0] % (triad[1] * triad[2]):
            raise ValueError(f"train_batch_size {triad[0]} is not train_micro_batch_size_per_gpu {triad[1]} × "
                             f"gradient_accumulation_steps {triad[2]} × a whole number of data-parallel ranks "
                             f"({triad[0]} / {triad[1] * triad[2]} = {triad[0] / (triad[1] * triad[2]):g})")
        return self

    def _refuse_what_is_not_built(self) -> None:
        from ._version import DS_VERSION

        def refuse(what: str, fix: str) -> None:
            raise ValueError(f"{what} is not implemented in ds-all {DS_VERSION}; {fix}")

        for section in (self.tensor_parallel, self.compile):
            what = section.refusal()
            if what is not None:
                refuse(what, "remove the key or turn it off")
        if self.gradient_allreduce_op == "sum":
            if self.zero_optimization.stage == 3:  # DeepSpeed's own refusal
                raise ValueError("gradient_allreduce_op 'sum' is not supported with ZeRO stage 3 (as in DeepSpeed)")
            refuse("gradient_allreduce_op 'sum' (summed data-parallel gradients)",
                   "use 'mean' and multiply the loss by the data-parallel world size for the same gradients")
        if not self.managed_gradient_accumulation:
            refuse("managed_gradient_accumulation false (the caller's own gradient accumulation)",
                   "remove the key: the engine accumulates over gradient_accumulation_steps")

    @classmethod
    def load(cls, config: Config | Mapping | str | os.PathLike) -> Config:
        """A `Config` from a dict, a JSON file's path, or a `Config` (returned as it is)."""
        if isinstance(config, cls):
            return config
        return cls.model_validate(load_ds_config(config))

    # DeepSpeed's ``engine.config`` is the config dict as given: Transformers' Trainer and Accelerate read it
    # with ``engine.config.get("zero_optimization", {}).get("stage")`` and ``"key" in engine.config``.
    def as_dict(self) -> dict[str, Any]:
        """The keys given (after ``"auto"`` values were resolved), by DeepSpeed's names, as a new dict."""
        return self.model_dump(by_alias=True, exclude_unset=True)

    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.as_dict()

    def get(self, key: str, default: Any = None) -> Any:
        """``config.get(key, default)`` as on DeepSpeed's config dict: the value given for ``key``."""
        return self.as_dict().get(key, default)

    def batch_triad(self, dp_world_size: int) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)`` for
        ``dp_world_size`` data-parallel ranks: any two given determine the third, one alone means no
        accumulation, as DeepSpeed derives them; a triad that does not multiply out is an error
        showing the arithmetic."""
        if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
            raise ValueError(f"dp_world_size must be a positive integer, got {dp_world_size!r}")
        train, micro, gas = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        for key, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                           ("gradient_accumulation_steps", gas)):
            if value == "auto":
                raise ValueError(f'{key} is "auto": resolve it first (Config.resolve(..., {key}=N) or the '
                                 "Hugging Face integration)")
        n = dp_world_size
        if train is None and micro is None:
            raise ValueError("give train_batch_size or train_micro_batch_size_per_gpu (or both); "
                             f"gradient_accumulation_steps={gas} alone does not say the batch size")
        if train is None:
            gas = gas or 1
            return micro * gas * n, micro, gas
        if micro is None:
            gas = gas or 1
            if train % (gas * n):
                raise ValueError(f"train_batch_size {train} is not divisible by gradient_accumulation_steps {gas} × "
                                 f"{n} data-parallel ranks = {gas * n}")
            return train, train // (gas * n), gas
        if gas is None:
            if train % (micro * n):
                raise ValueError(f"train_batch_size {train} is not divisible by train_micro_batch_size_per_gpu "
                                 f"{micro} × {n} data-parallel ranks = {micro * n}")
            return train, micro, train // (micro * n)
        if train != micro * gas * n:
            raise ValueError(f"train_batch_size {train} != train_micro_batch_size_per_gpu {micro} × "
                             f"gradient_accumulation_steps {gas} × {n} data-parallel ranks = {micro * gas * n}")
        return train, micro, gas

    def resolve(self, *, dp_world_size: int, **auto: Any) -> Config:
        """A copy with the batch triad filled in for ``dp_world_size`` ranks (from the ``elasticity``
        section when it is enabled: ds-launch's `compute_elastic_config`) and each ``"auto"``
        replaced by the value given for its key (``train_micro_batch_size_per_gpu=8``, or a dotted
        path as keyword-safe name with ``__``: ``zero_optimization__reduce_bucket_size=...``). An
        ``"auto"`` left anywhere is an error naming its key."""
        data = self.model_dump(by_alias=True, exclude_unset=True)
        for name, value in auto.items():
            path = name.split("__")
            holder = data
            for part in path[:-1]:
                holder = holder.setdefault(part, {})
            if holder.get(path[-1]) != "auto":
                raise ValueError(f"{'.'.join(path)} is not \"auto\" in this config (it is "
                                 f"{holder.get(path[-1])!r}); only \"auto\" values are resolved")
            holder[path[-1]] = value
        resolved = Config.model_validate(data)
        if resolved.elasticity.enabled:
            if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
                raise ValueError(f"dp_world_size must be a positive integer, got {dp_world_size!r}")
            train, micro, gas = elastic_batch_triad(data, dp_world_size)
        else:
            train, micro, gas = resolved.batch_triad(dp_world_size)
        data.update(train_batch_size=train, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas)
        resolved = Config.model_validate(data)
        left = [key for key in _autos(resolved.model_dump(by_alias=True)) if key not in MEANINGFUL_AUTO]
        if left:
            raise ConfigError([(key, 'is "auto" and nothing resolved it') for key in left])
        return resolved


def _autos(value: Any, path: str = "") -> list[str]:
    if value == "auto":
        return [path]
    if isinstance(value, Mapping):
        return [k for key, item in value.items() for k in _autos(item, f"{path}.{key}" if path else str(key))]
    if isinstance(value, list):
        return [k for i, item in enumerate(value) for k in _autos(item, f"{path}[{i}]")]
    return []
