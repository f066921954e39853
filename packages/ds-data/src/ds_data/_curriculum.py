"""`CurriculumScheduler`: the difficulty (a sequence length, a percentile, ...) at each training step.

DeepSpeed's schedules, formula for formula (``deepspeed/runtime/data_pipeline/curriculum_scheduler.py``):

* ``fixed_root`` (degree r) and ``fixed_linear`` (r = 1): ``d = floor((step / total_curriculum_step) ** (1/r)
  * (max - min) + min)``, rounded down to a multiple of ``difficulty_step``, raised to the first multiple of
  ``difficulty_step`` at or above ``min`` (rounding down must not go below the start) and capped at ``max``;
* ``fixed_discrete``: ``difficulty[i]`` for the first ``i`` with ``step <= max_step[i]``, the last difficulty
  after the last ``max_step``;
* ``custom``: the function given to `CurriculumScheduler.set_custom_get_difficulty`.

`CurriculumScheduler.update_difficulty` moves the current difficulty only while it is below
``max_difficulty``: once reached, the difficulty stays there.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from .config import CurriculumLearningConfig

logger = logging.getLogger(__name__)

_STATE_KEYS = ("min_difficulty", "max_difficulty", "current_difficulty", "schedule_type", "schedule_config")


def _validated(config: Any) -> CurriculumLearningConfig:
    if isinstance(config, CurriculumLearningConfig):
        section = config
    elif isinstance(config, Mapping):
        section = CurriculumLearningConfig.model_validate(dict(config))
    else:
        raise ValueError("CurriculumScheduler: config must be a dict of the curriculum keys (min_difficulty, "
                         "max_difficulty, schedule_type, schedule_config) or a CurriculumLearningConfig, got "
                         f"{type(config).__name__}")
    section.check_complete()
    return section


class CurriculumScheduler:
    """The difficulty schedule of a curriculum (DeepSpeed's ``CurriculumScheduler``).

    ``config``: a dict with ``min_difficulty``, ``max_difficulty``, ``schedule_type`` and
    ``schedule_config`` (the keys of the ``curriculum_learning`` section; ``enabled`` and
    ``curriculum_type`` may be there too), or a `CurriculumLearningConfig`. A missing or bad value is a
    ``ValueError`` naming it. The difficulty starts at ``min_difficulty``."""

    def __init__(self, config: Mapping[str, Any] | CurriculumLearningConfig) -> None:
        section = _validated(config)
        self.state: dict[str, Any] = {
            "min_difficulty": section.min_difficulty, "max_difficulty": section.max_difficulty,
            "current_difficulty": section.min_difficulty, "schedule_type": section.schedule_type,
            "schedule_config": section.schedule_config.given()}
        self.custom_get_difficulty: Callable[[int], int] | None = None
        step = self.state["schedule_config"].get("difficulty_step")
        if section.schedule_type in ("fixed_linear", "fixed_root") and step % 8 != 0:
            logger.warning("curriculum: difficulty_step %d is not a multiple of 8; with the seqlen metric, sequence "
                           "lengths that are multiples of 8 (fp16) or 16 (int8) use NVIDIA Tensor Cores. Disregard "
                           "this if the metric or the hardware is another", step)

    # ------------------------------------------------------------------------------ the schedule
    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        """The function ``global_steps -> difficulty`` of a ``custom`` schedule."""
        if not callable(schedule_function):
            raise ValueError(f"set_custom_get_difficulty needs a callable (global_steps -> difficulty), got "
                             f"{type(schedule_function).__name__}")
        self.custom_get_difficulty = schedule_function

    def get_difficulty(self, global_steps: int) -> int:
        """The schedule's difficulty at ``global_steps`` (the current difficulty is not changed)."""
        kind = self.state["schedule_type"]
        if kind == "fixed_discrete":
            return self._discrete(global_steps)
        if kind == "fixed_linear":
            return self._root(global_steps, 1)
        if kind == "fixed_root":
            return self._root(global_steps, self.state["schedule_config"]["root_degree"])
        if self.custom_get_difficulty is None:
            raise RuntimeError("curriculum schedule_type 'custom' has no difficulty function: call "
                               "set_custom_get_difficulty(fn) first")
        return self.custom_get_difficulty(global_steps)

    def _discrete(self, global_steps: int) -> int:
        schedule = self.state["schedule_config"]
        for difficulty, last_step in zip(schedule["difficulty"], schedule["max_step"], strict=False):
            if global_steps <= last_step:
                return difficulty
        return schedule["difficulty"][-1]

    def _root(self, global_steps: int, root_degree: float) -> int:
        low, high = self.state["min_difficulty"], self.state["max_difficulty"]
        schedule = self.state["schedule_config"]
        step = schedule["difficulty_step"]
        fraction = (float(global_steps) / schedule["total_curriculum_step"]) ** (1.0 / root_degree)
        difficulty = math.floor(fraction * (high - low) + low)
        difficulty -= difficulty % step
        difficulty = max(difficulty, -(-low // step) * step)  # not below the first multiple of step >= min
        return min(difficulty, high)

    def update_difficulty(self, global_steps: int) -> int:
        """Move the current difficulty to the schedule's at ``global_steps`` unless it already reached
        ``max_difficulty``; return it."""
        if self.state["current_difficulty"] < self.state["max_difficulty"]:
            self.state["current_difficulty"] = self.get_difficulty(global_steps)
        return self.state["current_difficulty"]

    def get_current_difficulty(self) -> int:
        return self.state["current_difficulty"]

    def set_current_difficulty(self, difficulty: int) -> None:
        if isinstance(difficulty, bool) or not isinstance(difficulty, int):
            raise ValueError(f"set_current_difficulty needs an integer difficulty, got {difficulty!r}")
        self.state["current_difficulty"] = difficulty

    # --------------------------------------------------------------------------------- its state
    def state_dict(self) -> dict[str, Any]:
        """The schedule and the current difficulty, as JSON values (a copy)."""
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned (the schedule too, as DeepSpeed's ``set_state``); the custom
        function, which is code, stays the one set here."""
        if not isinstance(state, Mapping) or set(state) != set(_STATE_KEYS):
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"a CurriculumScheduler state has the keys {list(_STATE_KEYS)}, got {got}")
        section = _validated({key: state[key] for key in _STATE_KEYS if key != "current_difficulty"})
        current = state["current_difficulty"]
        if isinstance(current, bool) or not isinstance(current, int):
            raise ValueError(f"a CurriculumScheduler state's current_difficulty must be an integer, got {current!r}")
        self.state = {"min_difficulty": section.min_difficulty, "max_difficulty": section.max_difficulty,
                      "current_difficulty": current, "schedule_type": section.schedule_type,
                      "schedule_config": section.schedule_config.given()}

    get_state = state_dict  # DeepSpeed's older names
    set_state = load_state_dict
