"""``zero_optimization.zenflow``: DeepSpeed's ZenFlow, key for key, with DeepSpeed's defaults and refusals.

What DeepSpeed 0.19.8 refuses is refused here too, as a ``ValueError`` naming the value and what is allowed:
its section's own checks, and those it makes only when the optimizer is built (``select_strategy`` "auto" with
a number for ``select_interval``, a number for ``select_interval`` below ``update_interval``). ds also refuses
a negative ``select_interval`` or ``full_warm_up_rounds`` (DeepSpeed takes them and misbehaves: a negative
interval reselects every step, negative rounds count down from a step that never comes); see the README.
"""

from __future__ import annotations

from typing import Literal

from ds_config import Section
from pydantic import Field, model_validator


class ZenFlowConfig(Section):
    """DeepSpeed's ZenFlow: the most important gradient columns (``topk_ratio`` of each weight matrix's
    columns, by the sum of their gradients' magnitudes) are stepped every micro-step on the model's
    parameters; the whole gradient is accumulated over ``update_interval`` micro-steps and stepped by the
    offloaded CPU optimizer (with ``overlap_step``: in the background, its result reaching the model one
    update later)."""

    topk_ratio: float = Field(0.1, gt=0.0, lt=1.0, description="Fraction of each weight matrix's columns "
                              "updated every micro-step (0 < ratio < 1).")
    select_strategy: Literal["auto", "step", "epoch"] = Field("auto", description="When the columns are "
                                                               "chosen again: every select_interval steps "
                                                               "('step') or epochs ('epoch'); 'auto' is every "
                                                               "epoch.")
    select_interval: Literal["auto"] | int = Field("auto", description="Steps or epochs between column "
                                                   "selections; 'auto' with select_strategy 'auto' (0: never "
                                                   "again after the first).")
    update_interval: Literal["auto"] | int = Field("auto", description="Micro-steps whose whole gradients "
                                                   "are accumulated before the CPU optimizer steps them; 'auto' "
                                                   "lets the gradients decide (not built in ds: refused at use).")
    overlap_step: bool = Field(False, description="Run the CPU optimizer's step in the background while "
                                     "the next micro-steps compute; its result reaches the model one update "
                                     "later.")
    offload: bool = Field(False, description="Keep the selected columns' optimizer states on the CPU "
                                "(DeepSpeed saves accelerator memory; on a CPU model they are there already).")
    auto_ratio: float = Field(0.99, ge=0.0, le=1.0, description="update_interval 'auto': the fraction of "
                              "matrices whose unselected gradients must outweigh the selected ones before an "
                              "update.")
    full_warm_up_rounds: int = Field(0, ge=0, description="First micro-steps that update every parameter "
                                     "through the CPU optimizer, each one a step of its own (no selection).")
    pt_reserved_cores_perc: float = Field(0.5, ge=0.0, le=1.0, description="DeepSpeed's share of the CPU "
                                          "cores kept for training beside its optimizer process (ds steps in "
                                          "a thread and pins nothing: read, not used).")
    steps_per_epoch: int | None = Field(None, ge=1, exclude=True, description="Micro-steps per epoch, from "
                                        "the engine's training data loader (DeepSpeed sets it; not a user key).")

    @model_validator(mode="after")
    def _intervals(self):
        if isinstance(self.select_interval, int) and self.select_interval < 0:
            raise ValueError(f"zenflow.select_interval must be 'auto' or an integer >= 0 (0: select once), got "
                             f"{self.select_interval}")
        if isinstance(self.update_interval, int) and self.update_interval < 1:
            raise ValueError(f"zenflow.update_interval must be 'auto' or an integer >= 1, got {self.update_interval}")
        if self.select_strategy == "auto" and isinstance(self.select_interval, int):
            raise ValueError(f"zenflow.select_interval {self.select_interval} with select_strategy 'auto': 'auto' "
                             "selects once per epoch; set select_strategy to 'step' or 'epoch' to give an interval "
                             "(DeepSpeed refuses this too)")
        if self.select_strategy != "auto" and self.select_interval == "auto":
            raise ValueError(f"zenflow.select_strategy {self.select_strategy!r} needs an integer select_interval, "
                             "got 'auto' (DeepSpeed refuses this too)")
        interval = self.selection_interval()
        if isinstance(self.update_interval, int) and interval != 0 and interval < self.update_interval:
            raise ValueError(f"zenflow.select_interval ({interval} micro-steps) must be 0 or at least "
                             f"update_interval ({self.update_interval}) (DeepSpeed refuses this too)")
        return self

    def selection_interval(self) -> int:
        """Micro-steps between column selections (0: only the first): DeepSpeed's resolution of
        ``select_strategy``/``select_interval`` ('auto' is 1 epoch; epochs need ``steps_per_epoch``, else 0)."""
        if self.select_strategy == "step":
            return int(self.select_interval)
        epochs = 1 if self.select_strategy == "auto" else int(self.select_interval)
        return epochs * self.steps_per_epoch if self.steps_per_epoch is not None else 0
