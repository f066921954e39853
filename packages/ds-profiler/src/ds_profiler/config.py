"""``FlopsProfilerConfig``: the ``flops_profiler`` section of a DeepSpeed/ds config, key for key."""

from __future__ import annotations

import difflib
import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

SECTION = "flops_profiler"


def _integer(value: Any) -> Any:
    """Integers, also written as a float with no fraction (``5e8`` in JSON); never booleans."""
    if isinstance(value, bool):
        raise ValueError(f"must be an integer, got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"must be an integer, got {value!r}")
        return int(value)
    return value


Integer = Annotated[int, BeforeValidator(_integer), Field(strict=True)]


class FlopsProfilerConfig(BaseModel):
    """When and how the engine profiles a training step (``"flops_profiler"`` in ds_config.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    enabled: bool = Field(False, strict=True, description="Profile one training step.")
    recompute_fwd_factor: float = Field(
        0.0, strict=True, description="Fraction of the forward recomputed in the backward (activation "
        "checkpointing); the backward is estimated as (2 + recompute_fwd_factor) forwards.")
    profile_step: Integer = Field(1, description="The global training step at which to profile "
                                  "(earlier steps warm up).")
    module_depth: Integer = Field(-1, description="The depth down to which the aggregated profile is "
                                  "printed; -1: every depth.")
    top_modules: Integer = Field(1, description="How many top modules the aggregated profile lists per depth.")
    detailed: bool = Field(True, strict=True, description="Print the detailed per-module profile.")
    output_file: str | None = Field(None, description="Write the profile to this file; null: stdout.")

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            allowed = list(cls.model_fields)
            for key in data:
                if key not in cls.model_fields:
                    close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise ValueError(f"{SECTION}: unknown key {key!r}{hint} Allowed keys: {', '.join(allowed)}")
        return data

    @field_validator("recompute_fwd_factor", mode="before")
    @classmethod
    def _factor(cls, value: Any) -> float:
        # Strict like the other keys (and FlopsProfiler's own check): a JSON number, not true or "0.5".
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value < 0):
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
