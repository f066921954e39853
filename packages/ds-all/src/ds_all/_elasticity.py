"""The ``elasticity`` section (DeepSpeed's elastic training config, versions 0.1 and 0.2) and the batch
triad it gives the engine: ``Config.resolve`` takes ``train_batch_size``, the micro-batch size and the
gradient accumulation from ds-launch's `compute_elastic_config` for the data-parallel world size, as
DeepSpeed's runtime config does. The computation itself is ds-launch's (standard library only), so that
an elastic launcher and the engine agree."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ds_config import Section
from pydantic import Field, field_validator, model_validator

from ds_launch import ElasticityConfigError, compute_elastic_config

from ._version import DEEPSPEED_API_VERSION

log = logging.getLogger(__name__)

# The DeepSpeed release whose API ds follows: the target version elasticity is checked against.
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class ElasticityConfig(Section):
    """``elasticity``: one global batch size that many device counts train with (see ds-launch's
    `compute_elastic_config`); when enabled the batch triad comes from it."""

    section = "elasticity"

    enabled: bool = Field(False, description="Compute the global batch size for elastic training.")
    max_train_batch_size: int = Field(2000, gt=0, description="The largest acceptable global batch size "
                                      "(required when enabled).")
    micro_batch_sizes: list[int] = Field([2, 4, 6], min_length=1, description="The acceptable "
                                         "train_micro_batch_size_per_gpu values (required when enabled).")
    min_gpus: int = Field(1, ge=1, description="The fewest devices the search considers.")
    max_gpus: int = Field(10000, ge=1, description="The most devices the search considers.")
    min_time: float = Field(0, ge=0, description="Minutes a scheduler waits before scaling again (0: unknown; "
                            "v0.1 only).")
    version: float | str = Field(0.2, description="The elastic algorithm: 0.1 or 0.2 (0.2 works in nodes).")
    prefer_larger_batch: bool = Field(True, description="Among equally elastic batch sizes, take the larger.")
    ignore_non_elastic_batch_info: bool = Field(False, description="Ignore batch keys outside this section "
                                                "(false: they are an error when elasticity is enabled).")
    num_gpus_per_node: int = Field(1, ge=1, description="Devices per node (v0.2).")
    model_parallel_size: int = Field(1, ge=1, description="Tensor/model-parallel size (v0.2).")

    @field_validator("micro_batch_sizes")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        if any(m < 1 for m in value):
            raise ValueError(f"micro_batch_sizes must be positive integers, got {value}")
        return value

    @field_validator("version")
    @classmethod
    def _version(cls, value: float | str) -> float | str:
        try:
            number = float(value)
        except ValueError:
            number = None
        if number not in (0.1, 0.2):
            raise ValueError(f"version must be 0.1 or 0.2, got {value!r}")
        return value

    @model_validator(mode="after")
    def _required_when_enabled(self) -> ElasticityConfig:
        if self.enabled:
            missing = [k for k in ("max_train_batch_size", "micro_batch_sizes") if k not in self.model_fields_set]
            if missing:
                raise ValueError(f"{' and '.join(missing)} must be given when elasticity is enabled")
        if self.min_gpus > self.max_gpus:
            raise ValueError(f"min_gpus {self.min_gpus} must be <= max_gpus {self.max_gpus}")
        return self


def elasticity_enabled(ds_config: Mapping) -> bool:
    """DeepSpeed's ``elasticity_enabled``: whether ``ds_config`` (a dict) turns elasticity on."""
    return bool(ds_config.get("elasticity", {}).get("enabled", False))


def elastic_batch_triad(data: Mapping[str, Any], dp_world_size: int) -> tuple[int, int, int]:
    """``(train_batch_size, micro_batch_size, gradient_accumulation_steps)`` from the ``elasticity``
    section of the config dict ``data`` for ``dp_world_size`` data-parallel ranks. Batch keys outside
    the section are an `ElasticityConfigError` unless ``ignore_non_elastic_batch_info`` is true (then
    they are ignored); a world size the config does not allow is `ElasticityIncompatibleWorldSize`."""
    section = data["elasticity"]
    batch, _valid, micro = compute_elastic_config({"elasticity": dict(section)}, DEEPSPEED_API_VERSION,
                                                  world_size=dp_world_size)
    gas = batch // (micro * dp_world_size)
    # keys that agree with the result (a config resolved before) are no conflict: resolve stays idempotent
    given = [f"{key} {data[key]!r}" for key, value in zip(BATCH_KEYS, (batch, micro, gas), strict=True)
             if key in data and data[key] != value]
    if given and not section.get("ignore_non_elastic_batch_info", False):
        raise ElasticityConfigError(
            f"{', '.join(given)} given while elasticity is enabled: elasticity sets the batch triad (here "
            f"{batch}, {micro}, {gas}), so they would not be used; remove them or set "
            "elasticity.ignore_non_elastic_batch_info to true to ignore them")
    if given:
        log.warning("elasticity is enabled: %s ignored (ignore_non_elastic_batch_info is true)", ", ".join(given))
    log.info("elasticity: train_batch_size %d = micro-batch %d × %d accumulation steps × %d data-parallel ranks",
             batch, micro, gas, dp_world_size)
    return batch, micro, gas
