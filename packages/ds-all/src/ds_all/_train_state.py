"""The engine's parts that a checkpoint holds: the `Stateful` protocol the checkpointer walks, the run's counters
(`TrainState`), and when each part is restored (`Restore`).

A part the checkpointer walks has ``state_dict()`` (JSON values), ``load_state_dict(state)`` and ``restore``:
the condition under which ``load_checkpoint`` gives it its saved state back. A new stateful feature is one more
entry in the engine's ``states`` dict (`DeepSpeedEngine._checkpoint_states`); the checkpointer has no code of
its own for it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol


class Restore(enum.Enum):
    """When ``load_checkpoint`` restores a part's saved state."""

    ALWAYS = "always"  # even with load_module_only (what it does is read the checkpoint, e.g. log)
    RUN = "run"  # unless load_module_only
    SAME_WORLD = "same_world"  # unless load_module_only, and only on the world size it was saved on
    SCHEDULE = "schedule"  # unless load_module_only, and only with load_lr_scheduler_states

    def wanted(self, *, module_only: bool, same_world: bool, schedule: bool) -> bool:
        if self is Restore.ALWAYS:
            return True
        if module_only:
            return False
        return {Restore.RUN: True, Restore.SAME_WORLD: same_world, Restore.SCHEDULE: schedule}[self]


class RefusesPipeline(Protocol):
    """A part class that says whether a `PipelineEngine` can train with its feature: ``pipeline_refusal(config,
    module)`` is the error to raise (None: it can). `PipelineEngine` refuses from these declarations."""

    @staticmethod
    def pipeline_refusal(config: Any, module: Any) -> Exception | None: ...


class Stateful(Protocol):
    """A part the checkpointer saves and restores (see the module docstring)."""

    restore: Restore

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass
class TrainState:
    """The run's counters: optimizer steps (applied or skipped), samples seen by every data-parallel rank
    together, and micro-steps. DeepSpeed's engine attributes of the same names forward here."""

    global_steps: int = 0
    global_samples: int = 0
    micro_steps: int = 0
    restore = Restore.RUN

    def state_dict(self) -> dict[str, int]:
        return {"global_steps": self.global_steps, "global_samples": self.global_samples,
                "micro_steps": self.micro_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("global_steps", "global_samples", "micro_steps"):
            value = state.get(key) if isinstance(state, dict) else None
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"a TrainState's {key} must be a non-negative integer, got {value!r}")
        self.global_steps, self.global_samples = state["global_steps"], state["global_samples"]
        self.micro_steps = state["micro_steps"]
