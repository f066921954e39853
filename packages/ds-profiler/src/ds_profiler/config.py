"""``FlopsProfilerConfig``: the ``flops_profiler`` section of a DeepSpeed/ds config, key for key."""

from __future__ import annotations

import math
from typing import Any

from ds_config import Section
from pydantic import Field, field_validator

SECTION = "flops_profiler"


class FlopsProfilerConfig(Section):
    """When and how the engine profiles a training step (``"flops_profiler"`` in ds_config.json)."""

    section = SECTION

    enabled: bool = Field(False, description="Profile one training step.")
    recompute_fwd_factor: float = Field(
        0.0, description="Fraction of the forward recomputed in the backward (activation "
        "checkpointing); the backward is estimated as (2 + recompute_fwd_factor) forwards.")
    profile_step: int = Field(1, description="The global training step at which to profile "
                                  "(earlier steps warm up).")
    module_depth: int = Field(-1, description="The depth down to which the aggregated profile is "
                                  "printed; -1: every depth.")
    top_modules: int = Field(1, description="How many top modules the aggregated profile lists per depth.")
    detailed: bool = Field(True, description="Print the detailed per-module profile.")
    output_file: str | None = Field(None, description="Write the profile to this file; null: stdout.")

    @field_validator("recompute_fwd_factor")
    @classmethod
    def _factor(cls, value: float) -> float:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{SECTION}.recompute_fwd_factor must be a number >= 0, got {value!r}")
        return float(value)

    @field_validator("profile_step")
    @classmethod
    def _step(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"{SECTION}.profile_step must be >= 0, got {value}")
        return value

    @field_validator("module_depth")
    @classmethod
    def _depth(cls, value: int) -> int:
        if value < -1:
            raise ValueError(f"{SECTION}.module_depth must be -1 (every depth) or >= 0, got {value}")
        return value

    @field_validator("top_modules")
    @classmethod
    def _top(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"{SECTION}.top_modules must be >= 1, got {value}")
        return value

    def print_options(self) -> dict[str, Any]:
        """The keyword arguments of ``FlopsProfiler.print_model_profile`` this section asks for."""
        return {"profile_step": self.profile_step, "module_depth": self.module_depth,
                "top_modules": self.top_modules, "detailed": self.detailed, "output_file": self.output_file}
