"""The ``zero_optimization``, ``fp16`` and ``bf16`` sections of a DeepSpeed config, key for key.

Every key of DeepSpeed's reference is accepted with its default. Stage 3's keys carry DeepSpeed's
``stage3_`` names (the short names are accepted too); DeepSpeed's deprecated spellings are mapped
to the current keys with a warning. ``"auto"`` (the Hugging Face integration's placeholder) is kept
as written where DeepSpeed allows it, for the engine to resolve; it is never guessed here.
"""

from __future__ import annotations

import logging
import sys
from enum import StrEnum
from typing import Annotated, Any, Literal

from ds_config import Section
from pydantic import Field, field_validator, model_validator

from ._zenflow_config import ZenFlowConfig

logger = logging.getLogger(__name__)

SECTION = "zero_optimization"
Auto = Literal["auto"]
Positive = Annotated[int, Field(gt=0)]
NonNegative = Annotated[int, Field(ge=0)]


class OffloadDeviceEnum(StrEnum):
    """Where ``offload_optimizer`` / ``offload_param`` put their data (DeepSpeed's enum; the config
    takes the strings)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(StrEnum):
    """The states DeepSpeed's ``engine.offload_states(include=...)`` names."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


# DeepSpeed's old spellings -> the key that replaced them.
DEPRECATED = {
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "cpu_offload": "offload_optimizer",
    "cpu_offload_param": "offload_param",
    "cpu_offload_use_pin_memory": "pin_memory",
}
# Keys only stage 3 reads (their DeepSpeed names).
STAGE3_KEYS = (
    "offload_param", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save", "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params", "sub_group_size",
)


class _Offload(Section):
    device: Literal["none", "cpu", "nvme"] = Field("none", description="Where the data lives: none (the "
                                                   "accelerator), cpu, or nvme (ZeRO-Infinity, with nvme_path).")
    nvme_path: str | None = Field(None, description="Directory on the NVMe device for device 'nvme'.")
    pin_memory: bool = Field(False, description="Page-locked CPU buffers (faster host-device copies, "
                             "less pageable memory left).")

    @model_validator(mode="after")
    def _nvme_needs_a_path(self):
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("nvme_path is required when device is 'nvme'")
        return self


class OffloadOptimizerConfig(_Offload):
    """``zero_optimization.offload_optimizer``: the fp32 master copy and optimizer states off the
    accelerator, stepped there (ZeRO-Offload: CPU, stages 1-3; ZeRO-Infinity: NVMe, stage 3)."""

    buffer_count: int = Field(4, gt=0, description="Buffers for the optimizer states swapped to NVMe "
                              "(at least 4 for Adam: master, momentum, variance, gradient).")
    pipeline_read: bool = Field(False, description="Overlap reading the next sub-group's states from NVMe "
                                "with the step.")
    pipeline_write: bool = Field(False, description="Overlap writing the last sub-group's states to NVMe "
                                 "with the step.")
    fast_init: bool = Field(False, description="Faster initialisation of states offloaded to NVMe.")
    ratio: float = Field(1.0, ge=0.0, le=1.0, description="Fraction of the parameters whose optimizer "
                         "step runs on the CPU (ZeRO's partial offload).")
    super_offload: bool = Field(False, description="DeepSpeed's SuperOffload for Superchips (stage 3; not "
                                "implemented: true is refused at use).")
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0, description="SuperOffload: the fraction of CPU "
                                      "cores its CPU Adam uses (read only with super_offload).")


class OffloadParamConfig(_Offload):
    """``zero_optimization.offload_param``: stage 3's parameters off the accelerator (CPU or NVMe)."""

    buffer_count: int = Field(5, gt=0, description="Buffers for parameters swapped in from NVMe.")
    buffer_size: int = Field(100_000_000, gt=0, description="Elements per NVMe parameter buffer; at least "
                             "the largest parameter.")
    max_in_cpu: int = Field(1_000_000_000, ge=0, description="Elements kept in CPU memory when parameters "
                            "are offloaded to NVMe.")


DEFAULT_LEAF_CLASSES = ("transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                        "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                        "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock")  # DeepSpeed's


class LeafModuleConfig(Section):
    """``zero_optimization.leaf_module``: modules stage 3 fetches as one unit with their children."""

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_CLASSES),
                               description="Class names (or dotted paths) of leaf modules.")
    names: list[str] = Field(default_factory=list, description="Module names (as in named_modules()).")
    name_suffixes: list[str] = Field(default_factory=list, description="Suffixes of module names.")


class ZeroConfig(Section):
    """``zero_optimization``: what ZeRO partitions and how it moves it."""

    section = SECTION

    stage: int = Field(0, description="0: data parallel with a flat fp32 master copy; 1: optimizer states "
                       "partitioned; 2: and gradients; 3: and parameters.")
    contiguous_gradients: bool = Field(True, description="Copy gradients into one contiguous buffer as they "
                                       "are produced (no fragmentation in backward).")
    compute_grad_norm: bool = Field(True, description="Stages 1-2: compute the global gradient norm at "
                                    "each step (false is allowed only there, as in DeepSpeed).")
    overlap_comm: bool | None = Field(None, description="Reduce gradients while backward goes on; "
                                      "null: true at stage 3, false below (DeepSpeed's default).")
    reduce_scatter: bool = Field(True, description="Reduce gradients with reduce-scatter (each rank gets "
                                 "its partition) rather than all-reduce.")
    reduce_bucket_size: Positive | Auto = Field(500_000_000, description="Elements reduced at once.")
    use_multi_rank_bucket_allreduce: bool = Field(True, description="Combine the reductions of several "
                                                  "ranks' buckets into one all-reduce where reduce_scatter is off.")
    allgather_partitions: bool = Field(True, description="Gather the updated partitions with all-gather "
                                       "(rather than a broadcast per rank).")
    allgather_bucket_size: Positive = Field(500_000_000, description="Elements all-gathered at once.")
    grad_hooks: bool = Field(True, description="Stage 1: reduce gradients in backward hooks (the reference's key; "
                             "ds-zero always reduces from hooks).")
    round_robin_gradients: bool = Field(False, description="Stage 1-2 with CPU offload: copy gradients to "
                                        "the CPU rank by rank (parallel copies with many ranks).")
    load_from_fp32_weights: bool = Field(True, description="Initialise the fp32 master copy from the "
                                         "checkpoint's fp32 weights rather than its 16-bit model.")
    elastic_checkpoint: bool = Field(False, description="Load optimizer states saved by a different number "
                                     "of ranks.")
    ignore_unused_parameters: bool = Field(True, description="A parameter without a gradient in a step "
                                           "gets zero; false: an error naming it.")
    legacy_stage1: bool = Field(False, description="DeepSpeed's old stage-1 implementation (not provided; "
                                "true is refused at use).")
    offload_optimizer: OffloadOptimizerConfig | None = Field(None, description="Optimizer offload.")
    offload_param: OffloadParamConfig | None = Field(None, description="Parameter offload (stage 3).")
    sub_group_size: Positive = Field(1_000_000_000, description="Stage 3: elements per optimizer step "
                                     "sub-group (the unit swapped to NVMe).")
    prefetch_bucket_size: NonNegative | Auto = Field(
        50_000_000, alias="stage3_prefetch_bucket_size", description="Stage 3: elements of parameters "
        "fetched ahead of use.")
    param_persistence_threshold: NonNegative | Auto = Field(
        100_000, alias="stage3_param_persistence_threshold", description="Stage 3: parameters smaller "
        "than this stay whole on every rank.")
    model_persistence_threshold: NonNegative = Field(
        sys.maxsize, alias="stage3_model_persistence_threshold", description="Stage 3: at most this many "
        "elements stay whole in total.")
    max_live_parameters: NonNegative = Field(
        1_000_000_000, alias="stage3_max_live_parameters", description="Stage 3: elements gathered at any "
        "time, at most.")
    max_reuse_distance: NonNegative = Field(
        1_000_000_000, alias="stage3_max_reuse_distance", description="Stage 3: a parameter used again "
        "within this many elements is kept gathered.")
    gather_16bit_weights_on_model_save: bool = Field(
        False, alias="stage3_gather_16bit_weights_on_model_save", description="Stage 3: save_16bit_model "
        "gathers the whole 16-bit weights.")
    module_granularity_threshold: NonNegative = Field(
        0, alias="stage3_module_granularity_threshold", description="Stage 3: modules with fewer parameters "
        "are fetched with their parent (fewer hooks).")
    use_all_reduce_for_fetch_params: bool = Field(
        False, alias="stage3_use_all_reduce_for_fetch_params", description="Stage 3: fetch parameters with "
        "all-reduce instead of all-gather.")
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential", description="Stage 3: "
                                       "gather parameters one by one instead of in buckets.")
    parameter_alignment: bool = Field(False, description="Stages 1-2: pad each parameter in the flat buffers to "
                                      "a 16-byte boundary.")
    enable_sanity_checks: bool = Field(False, description="DeepSpeed's internal consistency checks (debugging).")
    save_muon_momentum_buffer_in_memory: bool = Field(False, description="Muon with NVMe offload: keep its "
                                                      "momentum in memory.")
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig, description="Stage 3: modules "
                                          "fetched as one unit.")
    zenflow: ZenFlowConfig | None = Field(None, description="DeepSpeed's ZenFlow (stage 2, bf16, "
                                          "offload_optimizer 'cpu'): see _zenflow_config.")
    zero_hpz_partition_size: NonNegative = Field(1, description="ZeRO++ hierarchical partitioning: ranks per "
                                              "secondary partition (1: off).")
    zero_quantized_weights: bool = Field(False, description="ZeRO++: quantized weight all-gather.")
    zero_quantized_nontrainable_weights: bool = Field(False, description="ZeRO++: frozen weights stored "
                                                      "quantized.")
    zero_quantized_gradients: bool = Field(False, description="ZeRO++: quantized gradient reduction.")
    mics_shard_size: int = Field(-1, ge=-1, description="MiCS: ranks per shard group (-1: off).")
    mics_hierarchical_params_gather: bool = Field(False, description="MiCS: two-level parameter gather.")
    memory_efficient_linear: bool = Field(True, description="Stage 3: a linear layer that keeps no full "
                                          "copy of its weight for backward.")
    pipeline_loading_checkpoint: bool = Field(False, description="Stage 3: load the checkpoint layer by layer.")
    override_module_apply: bool = Field(True, description="Stage 3: gather parameters around module.apply().")
    log_trace_cache_warnings: bool = Field(False, description="Stage 3: log when the prefetch trace changes.")

    @model_validator(mode="before")
    @classmethod
    def _deprecated_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not set(data) & set(DEPRECATED):
            return data
        data = dict(data)
        for old, new in DEPRECATED.items():
            if old not in data:
                continue
            value = data.pop(old)
            logger.warning("%s.%s is deprecated; use %s", SECTION, old, new if new != "pin_memory"
                           else "offload_optimizer.pin_memory / offload_param.pin_memory")
            if new == "pin_memory":  # read by cpu_offload / cpu_offload_param below, replaces nothing
                continue
            # DeepSpeed refuses the old and the new key together, whatever their values
            given = [key for key in (new, new.removeprefix("stage3_")) if key in data]
            if given:
                raise ValueError(f"give {old!r} (deprecated) or {given[0]!r}, not both")
            if old == "stage3_gather_fp16_weights_on_model_save":
                data[new] = value
            elif value is True:
                data[new] = {"device": "cpu", "pin_memory": data.get("cpu_offload_use_pin_memory", False)}
            elif value not in (False, None):
                raise ValueError(f"{old} must be true or false, got {value!r}")
        data.pop("cpu_offload_use_pin_memory", None)
        return data

    @field_validator("stage")
    @classmethod
    def _stage(cls, value: int) -> int:
        if value not in (0, 1, 2, 3):
            raise ValueError(f"{SECTION}.stage must be 0, 1, 2 or 3, got {value}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ZeroConfig:
        if self.overlap_comm is None:  # DeepSpeed's dynamic default, visible as the key's value
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        if not self.compute_grad_norm and self.stage not in (1, 2):
            raise ValueError(f"{SECTION}.compute_grad_norm false is allowed only at stage 1 or 2 (as in DeepSpeed), "
                             f"got stage {self.stage}")
        optimizer = self.offload_optimizer.device if self.offload_optimizer else "none"
        param = self.offload_param.device if self.offload_param else "none"
        if optimizer != "none" and self.stage == 0:
            raise ValueError(f"{SECTION}.offload_optimizer needs stage 1, 2 or 3 (offloading is of the "
                             f"partitioned optimizer states), got stage 0")
        if optimizer == "nvme" and self.stage != 3:
            raise ValueError(f"{SECTION}.offload_optimizer.device 'nvme' (ZeRO-Infinity) needs stage 3, "
                             f"got stage {self.stage}; stages 1-2 offload to 'cpu'")
        if param != "none" and self.stage != 3:
            raise ValueError(f"{SECTION}.offload_param needs stage 3 (parameters are partitioned only "
                             f"there), got stage {self.stage}")
        if self.stage < 3:
            given = [key for key in STAGE3_KEYS if key in self._given_keys() and key != "offload_param"]
            if given:
                logger.warning("%s: %s only read at stage 3; ignored at stage %d", SECTION,
                               ", ".join(given), self.stage)
        return self

    def _given_keys(self) -> set[str]:
        """The keys the config gave, by their DeepSpeed names."""
        names = {name: (field.alias or name) for name, field in type(self).model_fields.items()}
        return {names[name] for name in self.model_fields_set}

    @property
    def overlap(self) -> bool:
        """``overlap_comm`` resolved: as given, else true at stage 3 and false below."""
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    def to_ds_config(self) -> dict[str, Any]:
        """The section as it appears in ds_config.json (DeepSpeed's key names)."""
        return {SECTION: self.model_dump(by_alias=True, exclude_none=True)}


class FP16Config(Section):
    """``fp16``: the model in float16 with a float32 master copy and loss scaling."""

    section = "fp16"

    enabled: bool | Auto = Field(False, description="Train in float16.")
    auto_cast: bool = Field(False, description="Cast the inputs of the model's forward to float16.")
    loss_scale: float = Field(0.0, ge=0.0, description="0: dynamic loss scaling; > 0: this static scale.")
    initial_scale_power: int = Field(16, ge=0, le=64, description="Dynamic scaling starts at "
                                     "2**initial_scale_power.")
    loss_scale_window: int = Field(1000, gt=0, description="Steps without overflow before the scale doubles.")
    hysteresis: int = Field(2, gt=0, description="Overflows tolerated before the scale is halved.")
    consecutive_hysteresis: bool = Field(False, description="Refill the hysteresis after each step without "
                                         "overflow (only consecutive overflows lower the scale).")
    min_loss_scale: float = Field(1.0, gt=0.0, description="The dynamic scale never drops below this.")
    fp16_master_weights_and_grads: bool = Field(False, description="Keep the master weights and gradients in "
                                                "float16 too (CPU offload only in DeepSpeed; refused at use).")

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0.0


class BF16Config(Section):
    """``bf16``: the model in bfloat16 with a float32 master copy (no loss scaling needed)."""

    section = "bf16"

    enabled: bool | Auto = Field(False, description="Train in bfloat16.")
    immediate_grad_update: bool = Field(False, description="Apply each gradient to the float32 "
                                        "accumulator as soon as it is produced.")
    check_grad_overflow: bool = Field(True, description="Skip the optimizer step (on every rank) when a "
                                      "gradient is inf or NaN, as fp16 does.")
    bf16_master_weights_and_grads: bool = Field(False, description="Keep the master weights and gradients in "
                                                "bfloat16 (no float32 copy; ZeRO stages 1-3).")
    bf16_optimizer_states: bool = Field(False, description="Keep the optimizer states in bfloat16 too (needs "
                                        "bf16_master_weights_and_grads; without it, bf16 master weights keep "
                                        "float32 states, which need offload_optimizer.device 'cpu').")

    @model_validator(mode="after")
    def _states_need_master(self) -> BF16Config:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ValueError("bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads true (as in "
                             "DeepSpeed)")
        return self


def mixed_precision(fp16: FP16Config | None = None, bf16: BF16Config | None = None) -> str:
    """Which precision the two sections ask for: "fp16", "bf16" or "fp32"; both on is an error, and so
    is an ``"auto"`` left unresolved."""
    fp16, bf16 = fp16 or FP16Config(), bf16 or BF16Config()
    for name, section in (("fp16", fp16), ("bf16", bf16)):
        if section.enabled == "auto":
            raise ValueError(f"{name}.enabled is \"auto\": the engine (or you) must resolve it to true or "
                             "false first")
    if fp16.enabled and bf16.enabled:
        raise ValueError("fp16.enabled and bf16.enabled are both true; enable one of them")
    return "fp16" if fp16.enabled else "bf16" if bf16.enabled else "fp32"
