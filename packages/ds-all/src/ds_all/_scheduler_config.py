"""`SchedulerConfig`: the ``scheduler`` section of a DeepSpeed config; `build_scheduler` makes the schedule."""

from __future__ import annotations

import difflib
import inspect
import logging
from typing import Any

from ds_config import ConfigError, Section
from pydantic import Field, field_validator, model_validator

from .lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

logger = logging.getLogger(__name__)

SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}


def _parameters(name: str) -> dict[str, inspect.Parameter]:
    """The constructor's keyword parameters of a schedule, the optimizer left out."""
    parameters = dict(inspect.signature(SCHEDULES[name]).parameters)
    parameters.pop("optimizer")
    return parameters


class SchedulerConfig(Section):
    """DeepSpeed's ``scheduler`` section: a schedule by name and its constructor's arguments. No
    ``type`` (or no section) means no schedule."""

    section = "scheduler"

    type: str | None = Field(None, description="The schedule: WarmupLR, WarmupDecayLR, WarmupCosineLR, "
                                               "OneCycle or LRRangeTest (ds_all.lr_schedules).")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the schedule's "
                                   "constructor (the optimizer is passed by the engine); 'auto' is kept as "
                                   "written and must be resolved before the schedule is built.")

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str | None) -> str | None:
        if value is None or value in SCHEDULES:
            return value
        by_lower = {name.lower(): name for name in SCHEDULES}
        close = difflib.get_close_matches(value.lower(), list(by_lower), n=1, cutoff=0.6)
        hint = f"; did you mean {by_lower[close[0]]!r}?" if close else ""
        raise ValueError(f"unknown schedule {value!r}{hint} Allowed: {', '.join(SCHEDULES)}")

    @model_validator(mode="after")
    def _params_fit_the_schedule(self) -> SchedulerConfig:
        if self.type is None:
            if self.params:
                raise ConfigError([("type", f"is required when params are given (one of {', '.join(SCHEDULES)})")])
            return self
        parameters = _parameters(self.type)
        problems: list[tuple[str, str]] = []
        for key in self.params:
            if key not in parameters:
                close = difflib.get_close_matches(key, list(parameters), n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                problems.append((f"params.{key}", f"unknown parameter {key!r} of {self.type}{hint} "
                                                  f"Allowed: {', '.join(parameters)}"))
        for name, parameter in parameters.items():
            if parameter.default is inspect.Parameter.empty and name not in self.params:
                problems.append((f"params.{name}", f"is required by {self.type}"))
        if problems:
            raise ConfigError(problems)
        return self


def build_scheduler(config: Any, optimizer: Any):
    """The learning-rate schedule a DeepSpeed config asks for, driving ``optimizer``; None when it asks for
    none.

    ``config`` is a `SchedulerConfig`, the ``scheduler`` section as a dict
    (``{"type": "WarmupLR", "params": {...}}``), a whole DeepSpeed config as a dict, or the path of a JSON
    file holding one. Bad sections raise `ds_config.ConfigError` (a ValueError) naming the key; bad values
    raise ValueError from the schedule, naming the parameter.
    """
    section = SchedulerConfig.from_section_or_ds_config(config)
    if section.type is None:
        return None
    autos = [key for key, value in section.params.items() if isinstance(value, str) and value == "auto"]
    if autos:  # kept by the section as written (Config.resolve fills them in), never guessed here
        raise ConfigError([(f"params.{key}", "is 'auto', which a schedule cannot resolve: resolve it first "
                                             "(ds_all.Config.resolve) or give a value") for key in autos], "scheduler")
    schedule = SCHEDULES[section.type](optimizer, **section.params)
    logger.debug("built %s(%s)", section.type, section.params)
    return schedule
