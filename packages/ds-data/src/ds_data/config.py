"""The config sections of ds-data, key for key as DeepSpeed names them.

``curriculum_learning`` (the top-level, sequence-length curriculum DeepSpeed calls "legacy") is
`CurriculumLearningConfig`; its ``schedule_config`` is `ScheduleConfig`. ``progressive_layer_drop`` is
`ProgressiveLayerDropConfig`. A section that is off may leave its keys out; one that is on must give
what its schedule needs, and every value given is checked whether the section is on or off.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from ds_config import Section
from pydantic import Field, field_validator, model_validator

CURRICULUM = "curriculum_learning"
PLD = "progressive_layer_drop"
SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")
CURRICULUM_TYPES = ("seqlen",)


def _choice(value: str, key: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{key} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")
    return value


class ScheduleConfig(Section):
    """The ``schedule_config`` of a curriculum: which keys a schedule reads depends on its ``schedule_type``
    (``fixed_linear``: total_curriculum_step, difficulty_step; ``fixed_root``: those and root_degree;
    ``fixed_discrete``: difficulty, max_step; ``custom``: none)."""

    total_curriculum_step: int | None = Field(
        None, description="fixed_linear/fixed_root: the step at which the difficulty reaches max_difficulty.")
    difficulty_step: int | None = Field(
        None, description="fixed_linear/fixed_root: every difficulty is rounded down to a multiple of this "
        "(a multiple of 8 keeps fp16 sequence lengths Tensor-Core friendly; DeepSpeed warns otherwise).")
    root_degree: int | float | None = Field(
        None, description="fixed_root: the degree of the root (2: square root; 1 is fixed_linear).")
    difficulty: list[int] | None = Field(
        None, description="fixed_discrete: the difficulties in order (one more than max_step).")
    max_step: list[int] | None = Field(
        None, description="fixed_discrete: the last step of each difficulty but the last, increasing.")

    @field_validator("total_curriculum_step", "difficulty_step")
    @classmethod
    def _positive(cls, value: int | None, info) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"schedule_config.{info.field_name} must be a positive integer, got {value}")
        return value

    @field_validator("root_degree")
    @classmethod
    def _degree(cls, value: int | float | None) -> int | float | None:
        if value is not None and (isinstance(value, bool) or not math.isfinite(value) or value <= 0):
            raise ValueError(f"schedule_config.root_degree must be a number > 0, got {value!r}")
        return value

    @field_validator("difficulty", "max_step")
    @classmethod
    def _not_empty(cls, value: list[int] | None, info) -> list[int] | None:
        if value is not None and not value:
            raise ValueError(f"schedule_config.{info.field_name} must not be empty, got []")
        return value

    @field_validator("max_step")
    @classmethod
    def _increasing(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(b <= a for a, b in itertools.pairwise(value)):
            raise ValueError(f"schedule_config.max_step must be increasing (the last step of each difficulty), "
                             f"got {value}")
        return value

    def given(self) -> dict[str, Any]:
        """The keys given, as a plain dict (DeepSpeed's ``schedule_config``)."""
        return {key: value for key, value in self.model_dump().items() if value is not None}


class CurriculumLearningConfig(Section):
    """The top-level ``curriculum_learning`` section (DeepSpeed's legacy sequence-length curriculum): while
    it is on, the engine passes ``curriculum_seqlen=<the current difficulty>`` to the model's forward."""

    section = CURRICULUM

    enabled: bool = Field(False, description="Schedule the sequence length and pass it to the model's forward.")
    curriculum_type: str = Field("seqlen", description="What the difficulty is: \"seqlen\", the sequence length "
                                 "the engine passes as curriculum_seqlen (the only type DeepSpeed acts on).")
    min_difficulty: int | None = Field(None, description="The difficulty at step 0 (required when enabled).")
    max_difficulty: int | None = Field(None, description="The difficulty the schedule ends at (required when "
                                       "enabled); once reached it no longer changes.")
    schedule_type: str | None = Field(None, description="fixed_linear, fixed_root, fixed_discrete or custom "
                                      "(required when enabled).")
    schedule_config: ScheduleConfig = Field(default_factory=ScheduleConfig,
                                            description="The schedule's parameters (see ScheduleConfig).")

    @field_validator("curriculum_type")
    @classmethod
    def _type(cls, value: str) -> str:
        return _choice(value, f"{CURRICULUM}.curriculum_type", CURRICULUM_TYPES)

    @field_validator("schedule_type")
    @classmethod
    def _schedule(cls, value: str | None) -> str | None:
        return None if value is None else _choice(value, f"{CURRICULUM}.schedule_type", SCHEDULE_TYPES)

    @field_validator("min_difficulty", "max_difficulty")
    @classmethod
    def _difficulty(cls, value: int | None, info) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"{CURRICULUM}.{info.field_name} must be >= 0, got {value}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> CurriculumLearningConfig:
        low, high = self.min_difficulty, self.max_difficulty
        if low is not None and high is not None and low > high:
            raise ValueError(f"{CURRICULUM}.min_difficulty {low} is above max_difficulty {high}")
        if self.enabled:
            self.check_complete()
        return self

    def check_complete(self) -> None:
        """Raise a `ValueError` naming each key the schedule needs and was not given, or a
        fixed_discrete schedule whose lists do not pair up."""
        missing = [key for key in ("min_difficulty", "max_difficulty", "schedule_type") if getattr(self, key) is None]
        schedule, kind = self.schedule_config, self.schedule_type
        needs = {"fixed_linear": ("total_curriculum_step", "difficulty_step"),
                 "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
                 "fixed_discrete": ("difficulty", "max_step")}.get(kind or "", ())
        missing += [f"schedule_config.{key}" for key in needs if getattr(schedule, key) is None]
        if missing:
            why = f" (schedule_type {kind!r} needs them)" if any("." in m for m in missing) else ""
            raise ValueError(f"{CURRICULUM} needs {', '.join(missing)}{why}")
        if kind == "fixed_discrete" and len(schedule.difficulty) != len(schedule.max_step) + 1:
            raise ValueError(f"{CURRICULUM}.schedule_config.difficulty must have one more entry than max_step (the "
                             f"last difficulty holds after the last max_step), got {len(schedule.difficulty)} "
                             f"difficulties and {len(schedule.max_step)} max_step entries")

    def params(self) -> dict[str, Any]:
        """The section without ``enabled``, as DeepSpeed's ``curriculum_params_legacy()`` returns it."""
        out: dict[str, Any] = {"curriculum_type": self.curriculum_type}
        for key in ("min_difficulty", "max_difficulty", "schedule_type"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["schedule_config"] = self.schedule_config.given()
        return out


class ProgressiveLayerDropConfig(Section):
    """The ``progressive_layer_drop`` section: while it is on, the engine passes
    ``progressive_layer_drop=True, pld_theta=θ(step)`` to the model's forward in training."""

    section = PLD

    enabled: bool = Field(False, description="Compute the keep ratio theta each step and pass it to forward.")
    theta: float = Field(1.0, description="The keep ratio theta converges to, in (0, 1] (DeepSpeed's default "
                         "1.0 drops nothing; the PLD paper uses 0.5).")
    gamma: float = Field(0.001, description="How fast theta falls from 1 to its final value: "
                         "theta(t) = (1 - theta) * exp(-gamma * t) + theta; >= 0.")

    @field_validator("theta")
    @classmethod
    def _theta(cls, value: float) -> float:
        if not (0.0 < value <= 1.0):
            raise ValueError(f"{PLD}.theta must be in (0, 1] (the final keep ratio), got {value!r}")
        return float(value)

    @field_validator("gamma")
    @classmethod
    def _gamma(cls, value: float) -> float:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{PLD}.gamma must be a number >= 0, got {value!r}")
        return float(value)

    def params(self) -> dict[str, float]:
        """The section without ``enabled``, as DeepSpeed's ``pld_params()`` returns it."""
        return {"theta": self.theta, "gamma": self.gamma}
