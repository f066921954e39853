"""``CompressionConfig``: the ``compression_training`` section of a DeepSpeed/ds config, key for key.

Seven techniques, each ``{"shared_parameters": {...}, "different_groups": {name: {"params": {...},
"modules": [...], "related_modules": [[...]]}}}`` except ``layer_reduction`` (flat keys).  Module
patterns are regular expressions searched (``re.search``) in the names of ``model.named_modules()``,
as in DeepSpeed; that a pattern matches something is checked by ``init_compression``, which has the model.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from ds_config import Section, load_ds_config
from pydantic import Field, field_validator, model_validator

SECTION = "compression_training"


class _Section(Section):
    """Base of every model here (ds-config's strict Section: did-you-mean, one value policy, frozen)."""


def _offset(value: int, key: str) -> int:
    if value < 0:
        raise ValueError(f"{key} must be >= 0 (a training step), got {value}")
    return value


def _dense_ratio(value: float) -> float:
    if isinstance(value, bool) or not (0.0 < float(value) <= 1.0):
        raise ValueError(f"dense_ratio must be in (0, 1] (the fraction of weights kept), got {value!r}")
    return float(value)


def _compiles(patterns: list[str]) -> None:
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{pattern!r} is not a valid regular expression ({e})") from None


class _Group(_Section):
    """One entry of ``different_groups``: which modules get which ``params``."""

    modules: list[str] | None = Field(
        None, description="Regular expressions searched in module names; null: every module the "
        "technique applies to (Linear and Conv2d layers; Conv2d only for channel pruning).")

    @field_validator("modules")
    @classmethod
    def _patterns(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("modules must list at least one pattern (or be omitted for every layer)")
        _compiles(value or [])
        return value


class _RelatedGroup(_Group):
    related_modules: list[list[str]] | None = Field(
        None, description="For each pattern of modules, the patterns of the modules whose input "
        "dimension follows the pruned output dimension (resized by redundancy_clean).")

    @field_validator("related_modules")
    @classmethod
    def _related_patterns(cls, value: list[list[str]] | None) -> list[list[str]] | None:
        for patterns in value or []:
            _compiles(patterns)
        return value


# ----------------------------------------------------------------------------- weight quantization
class FP16MixedQuantizeConfig(_Section):
    enabled: bool = Field(False, description="Use a mix of the float weight and its quantized value.")
    quantize_change_ratio: float = Field(
        0.001, description="Initial share of the quantized value; it grows by this much every step up to 1.")

    @field_validator("quantize_change_ratio")
    @classmethod
    def _ratio(cls, value: float) -> float:
        if not (0.0 < value <= 1.0):
            raise ValueError(f"quantize_change_ratio must be in (0, 1], got {value!r}")
        return value


class WeightQuantizationSharedConfig(_Section):
    enabled: bool = Field(False, description="Enable weight quantization.")
    quantizer_kernel: bool = Field(
        False, description="DeepSpeed's fused quantizer kernel (FP16 optimizer only); ds-compress has "
        "no such kernel, so true is refused by init_compression.")
    schedule_offset: int = Field(0, description="Training step at which weight quantization starts.")
    quantize_groups: int = Field(1, description="Number of groups the weight is split into, each "
                                     "with its own scale.")
    quantize_verbose: bool = Field(False, description="Log every bit-width change.")
    quantization_type: Literal["symmetric", "asymmetric"] = Field(
        "symmetric", description="symmetric (scale only) or asymmetric (scale and zero point).")
    rounding: Literal["nearest", "stochastic"] = Field("nearest", description="nearest or stochastic rounding.")
    quantize_weight_in_forward: bool = Field(
        False, description="true: the forward uses the quantized weight (straight-through gradient), "
        "the float weight is kept; false: CompressionScheduler.step() quantizes the weights in place "
        "after each optimizer step.")
    fp16_mixed_quantize: FP16MixedQuantizeConfig = Field(
        default_factory=FP16MixedQuantizeConfig, description="Mix the float and the quantized weight.")

    @field_validator("schedule_offset")
    @classmethod
    def _off(cls, value: int) -> int:
        return _offset(value, "weight_quantization.shared_parameters.schedule_offset")

    @field_validator("quantize_groups")
    @classmethod
    def _groups(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"weight_quantization.shared_parameters.quantize_groups must be >= 1, got {value}")
        return value


# Training may start wide (DeepSpeed's own tests go 12 -> 8 bits); the final width is what
# redundancy_clean stores, at most one byte per weight.
MAX_WEIGHT_BITS = {"start_bits": 16, "target_bits": 8}


class WeightQuantizationParams(_Section):
    start_bits: int = Field(8, description="Bits at the start (1-16); reduced by 1 every "
                            "quantization_period steps.")
    target_bits: int = Field(8, description="Final bits (1-8), <= start_bits; 2: ternary, 1: binary.")
    quantization_period: int = Field(1, description="Steps between two reductions of the bit width.")

    @model_validator(mode="after")
    def _bits(self) -> WeightQuantizationParams:
        for key in ("start_bits", "target_bits"):
            value = getattr(self, key)
            if not 1 <= value <= MAX_WEIGHT_BITS[key]:
                raise ValueError(f"weight_quantization params.{key} must be between 1 and "
                                 f"{MAX_WEIGHT_BITS[key]}, got {value}")
        if self.target_bits > self.start_bits:
            raise ValueError(f"weight_quantization params.target_bits must be <= start_bits, got "
                             f"target_bits={self.target_bits} > start_bits={self.start_bits}")
        if self.quantization_period < 1:
            raise ValueError(f"weight_quantization params.quantization_period must be >= 1, got "
                             f"{self.quantization_period}")
        return self


class WeightQuantizationGroup(_Group):
    params: WeightQuantizationParams = Field(default_factory=WeightQuantizationParams,
                                             description="Bit widths of this group.")


class WeightQuantizationConfig(_Section):
    shared_parameters: WeightQuantizationSharedConfig = Field(
        default_factory=WeightQuantizationSharedConfig, description="Parameters shared by every group.")
    different_groups: dict[str, WeightQuantizationGroup] = Field(
        default_factory=dict, description="Named groups of modules with their own bit widths.")


# ------------------------------------------------------------------------- activation quantization
class ActivationQuantizationSharedConfig(_Section):
    enabled: bool = Field(False, description="Enable activation (layer input) quantization.")
    quantization_type: Literal["symmetric", "asymmetric"] = Field(
        "symmetric", description="symmetric or asymmetric.")
    range_calibration: Literal["dynamic", "static"] = Field(
        "static", description="dynamic: range of each token/image; static: running min/max "
        "(momentum 0.95) learned in training and fixed in eval.")
    schedule_offset: int = Field(0, description="Training step at which activation quantization starts.")

    @field_validator("schedule_offset")
    @classmethod
    def _off(cls, value: int) -> int:
        return _offset(value, "activation_quantization.shared_parameters.schedule_offset")


class ActivationQuantizationParams(_Section):
    bits: int = Field(8, description="Bits of the activations, >= 4.")

    @field_validator("bits")
    @classmethod
    def _bits(cls, value: int) -> int:
        if not 4 <= value <= 16:
            raise ValueError(f"activation_quantization params.bits must be between 4 and 16, got {value}")
        return value


class ActivationQuantizationGroup(_Group):
    params: ActivationQuantizationParams = Field(default_factory=ActivationQuantizationParams,
                                                 description="Bits of this group.")


class ActivationQuantizationConfig(_Section):
    shared_parameters: ActivationQuantizationSharedConfig = Field(
        default_factory=ActivationQuantizationSharedConfig, description="Parameters shared by every group.")
    different_groups: dict[str, ActivationQuantizationGroup] = Field(
        default_factory=dict, description="Named groups of modules with their own bits.")


# ---------------------------------------------------------------------------------------- pruning
class PruningParams(_Section):
    dense_ratio: float = Field(0.5, description="Fraction of weights (rows, heads, channels) kept, in (0, 1].")

    @field_validator("dense_ratio")
    @classmethod
    def _ratio(cls, value: float) -> float:
        return _dense_ratio(value)


class SparsePruningGroup(_Group):
    params: PruningParams = Field(default_factory=PruningParams, description="Dense ratio of this group.")


class StructuredPruningGroup(_RelatedGroup):
    params: PruningParams = Field(default_factory=PruningParams, description="Dense ratio of this group.")


class SparsePruningSharedConfig(_Section):
    enabled: bool = Field(False, description="Enable unstructured sparse pruning.")
    schedule_offset: int = Field(0, description="Training step at which sparse pruning starts.")
    schedule_offset_end: int | None = Field(
        None, description="Training step after which the mask stops changing (it is frozen and kept); "
        "null: never. Mandatory for snip_momentum.")
    schedule_offset_stride: int = Field(1, description="Steps between two mask updates (snip_momentum).")
    method: Literal["l1", "topk", "snip_momentum"] = Field(
        "l1", description="l1: magnitude mask fixed when pruning starts; topk: learned scores "
        "(straight-through); snip_momentum: structured (not implemented in 0.1.0, refused).")
    block_pattern: str = Field("4x1", description="NxM or N:M block pattern (snip_momentum).")
    dense_ratio: float = Field(0.1, description="Global dense ratio (snip_momentum).")
    excluded_modules: list[str] = Field(default_factory=list,
                                        description="Patterns of modules never pruned.")

    @field_validator("dense_ratio")
    @classmethod
    def _ratio(cls, value: float) -> float:
        return _dense_ratio(value)

    @field_validator("excluded_modules")
    @classmethod
    def _excluded(cls, value: list[str]) -> list[str]:
        _compiles(value)
        return value

    @field_validator("block_pattern")
    @classmethod
    def _pattern(cls, value: str) -> str:
        import re

        if not re.fullmatch(r"\d+[x:]\d+", value):
            raise ValueError(f"sparse_pruning.shared_parameters.block_pattern must be 'NxM' or 'N:M', got {value!r}")
        return value

    @model_validator(mode="after")
    def _schedule(self) -> SparsePruningSharedConfig:
        _offset(self.schedule_offset, "sparse_pruning.shared_parameters.schedule_offset")
        if self.schedule_offset_stride < 1:
            raise ValueError("sparse_pruning.shared_parameters.schedule_offset_stride must be >= 1, "
                             f"got {self.schedule_offset_stride}")
        if self.schedule_offset_end is not None and self.schedule_offset_end < self.schedule_offset:
            raise ValueError("sparse_pruning.shared_parameters.schedule_offset_end must be >= "
                             f"schedule_offset ({self.schedule_offset}), got {self.schedule_offset_end}")
        if self.method == "snip_momentum" and self.schedule_offset_end is None:
            raise ValueError("sparse_pruning.shared_parameters.schedule_offset_end is mandatory for snip_momentum")
        return self


class SparsePruningConfig(_Section):
    shared_parameters: SparsePruningSharedConfig = Field(
        default_factory=SparsePruningSharedConfig, description="Parameters shared by every group.")
    different_groups: dict[str, SparsePruningGroup] = Field(
        default_factory=dict, description="Named groups of modules with their own dense ratio.")


class _StructuredShared(_Section):
    enabled: bool = Field(False, description="Enable this pruning.")
    schedule_offset: int = Field(0, description="Training step at which this pruning starts.")
    method: Literal["l1", "topk"] = Field("l1", description="l1: magnitude mask fixed when pruning starts; "
                                          "topk: learned scores (straight-through).")

    @field_validator("schedule_offset")
    @classmethod
    def _off(cls, value: int) -> int:
        return _offset(value, "shared_parameters.schedule_offset")


class RowPruningSharedConfig(_StructuredShared):
    pass


class ChannelPruningSharedConfig(_StructuredShared):
    pass


class HeadPruningSharedConfig(_StructuredShared):
    method: Literal["topk", "l1"] = Field("topk", description="topk (learned head scores) or l1 "
                                          "(head magnitude, fixed when pruning starts).")
    num_heads: int | None = Field(None, description="Number of attention heads (required when enabled).")

    @model_validator(mode="after")
    def _heads(self) -> HeadPruningSharedConfig:
        if self.enabled and (self.num_heads is None or self.num_heads < 1):
            raise ValueError("head_pruning.shared_parameters.num_heads must be given (>= 1) when head "
                             f"pruning is enabled, got {self.num_heads!r}")
        return self


class RowPruningConfig(_Section):
    shared_parameters: RowPruningSharedConfig = Field(default_factory=RowPruningSharedConfig,
                                                      description="Parameters shared by every group.")
    different_groups: dict[str, StructuredPruningGroup] = Field(default_factory=dict, description="Groups.")


class HeadPruningConfig(_Section):
    shared_parameters: HeadPruningSharedConfig = Field(default_factory=HeadPruningSharedConfig,
                                                       description="Parameters shared by every group.")
    different_groups: dict[str, StructuredPruningGroup] = Field(default_factory=dict, description="Groups.")


class ChannelPruningConfig(_Section):
    shared_parameters: ChannelPruningSharedConfig = Field(default_factory=ChannelPruningSharedConfig,
                                                          description="Parameters shared by every group.")
    different_groups: dict[str, StructuredPruningGroup] = Field(default_factory=dict, description="Groups.")


# -------------------------------------------------------------------------------- layer reduction
class LayerReductionConfig(_Section):
    enabled: bool = Field(False, description="Enable layer reduction.")
    keep_number_layer: int | None = Field(None, description="Number of layers of module_name_prefix kept.")
    module_name_prefix: str | None = Field(None, description="Name of the layer list, e.g. 'bert.encoder.layer'.")
    teacher_layer: list[int] | None = Field(
        None, description="Teacher layer indices the kept layers are initialised from (keep_number_layer of them).")
    other_module_name: list[str] = Field(default_factory=list,
                                         description="Other modules copied from the teacher, by name.")

    @model_validator(mode="after")
    def _consistent(self) -> LayerReductionConfig:
        if not self.enabled:
            return self
        if self.module_name_prefix is None and not self.other_module_name:
            raise ValueError("layer_reduction needs module_name_prefix (with keep_number_layer and "
                             "teacher_layer) or other_module_name when enabled")
        if self.module_name_prefix is not None:
            if self.keep_number_layer is None or self.keep_number_layer < 1:
                raise ValueError(f"layer_reduction.keep_number_layer must be >= 1, got {self.keep_number_layer!r}")
            if self.teacher_layer is None or len(self.teacher_layer) != self.keep_number_layer:
                raise ValueError(f"layer_reduction.teacher_layer must list keep_number_layer="
                                 f"{self.keep_number_layer} indices, got {self.teacher_layer!r}")
            if any(i < 0 for i in self.teacher_layer):
                raise ValueError(f"layer_reduction.teacher_layer indices must be >= 0, got {self.teacher_layer}")
        return self


# ------------------------------------------------------------------------------------ the section
TECHNIQUES = ("weight_quantization", "activation_quantization", "sparse_pruning", "row_pruning",
              "head_pruning", "channel_pruning")


class CompressionConfig(_Section):
    """The ``"compression_training"`` section of ds_config.json."""

    section = SECTION

    layer_reduction: LayerReductionConfig = Field(default_factory=LayerReductionConfig,
                                                  description="Keep fewer layers, initialised from a teacher.")
    weight_quantization: WeightQuantizationConfig = Field(default_factory=WeightQuantizationConfig,
                                                          description="Quantize weights.")
    activation_quantization: ActivationQuantizationConfig = Field(
        default_factory=ActivationQuantizationConfig, description="Quantize layer inputs.")
    sparse_pruning: SparsePruningConfig = Field(default_factory=SparsePruningConfig,
                                                description="Unstructured pruning.")
    row_pruning: RowPruningConfig = Field(default_factory=RowPruningConfig,
                                          description="Prune output rows of Linear layers.")
    head_pruning: HeadPruningConfig = Field(default_factory=HeadPruningConfig,
                                            description="Prune attention heads (input blocks of the output projection).")
    channel_pruning: ChannelPruningConfig = Field(default_factory=ChannelPruningConfig,
                                                  description="Prune output channels of Conv2d layers.")

    @model_validator(mode="after")
    def _groups_present(self) -> CompressionConfig:
        for name in TECHNIQUES:
            technique = getattr(self, name)
            shared = technique.shared_parameters
            if shared.enabled and not technique.different_groups and getattr(shared, "method", "") != "snip_momentum":
                raise ValueError(f"{SECTION}.{name} is enabled but different_groups is empty: nothing to compress")
        return self

    @classmethod
    def load(cls, config: Any) -> CompressionConfig:
        """A ``CompressionConfig``, a dict (the section, or a whole ds config holding it), or a JSON
        path (of a whole config, or of the section alone)."""
        if isinstance(config, (str, os.PathLike)):
            config = load_ds_config(config)
        if not isinstance(config, (cls, dict)):
            raise ValueError(f"{SECTION}: expected a CompressionConfig, a dict or a path to a JSON config, "
                             f"got {type(config).__name__}")
        return cls.from_section_or_ds_config(config)
