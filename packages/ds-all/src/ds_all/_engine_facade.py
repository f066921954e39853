"""`PartsFacade`: DeepSpeed's engine attributes that are state of a part, as properties forwarding to the part.

DeepSpeed's scripts read and assign ``engine.global_steps``, ``engine.lr_scheduler``, ``engine.training_dataloader``
and the like; in ds the counters are `TrainState`'s and each feature's objects its part's, so these names forward
to the part that owns the value (the engine, `DeepSpeedEngine`, builds the parts: ``train_state``,
``data_efficiency``, ``schedule``, ``loader_position``). Kept apart from the composition root so that it stays
a composition.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._checkpoint import ScheduleState
    from ._data import LoaderPosition
    from ._data_efficiency import DataEfficiency
    from ._train_state import TrainState


class PartsFacade:
    """DeepSpeed's names for state the engine's parts own (see the module docstring)."""

    train_state: TrainState
    data_efficiency: DataEfficiency
    schedule: ScheduleState
    loader_position: LoaderPosition

    @property
    def global_steps(self) -> int:
        return self.train_state.global_steps

    @global_steps.setter
    def global_steps(self, value: int) -> None:
        self.train_state.global_steps = value

    @property
    def global_samples(self) -> int:
        return self.train_state.global_samples

    @global_samples.setter
    def global_samples(self, value: int) -> None:
        self.train_state.global_samples = value

    @property
    def micro_steps(self) -> int:
        return self.train_state.micro_steps

    @micro_steps.setter
    def micro_steps(self, value: int) -> None:
        self.train_state.micro_steps = value

    @property
    def progressive_layer_drop(self) -> Any:
        """`ds_data.ProgressiveLayerDrop` of ``progressive_layer_drop``, or None when it is off."""
        return self.data_efficiency.progressive_layer_drop

    @property
    def curriculum_scheduler_legacy(self) -> Any:
        """`ds_data.CurriculumScheduler` of the top-level ``curriculum_learning``, or None when it is off."""
        return self.data_efficiency.curriculum_scheduler_legacy

    @property
    def random_ltd_scheduler(self) -> Any:
        """`ds_data.RandomLTDScheduler` of ``data_efficiency.data_routing.random_ltd``, or None when it is off."""
        return self.data_efficiency.random_ltd.scheduler

    @property
    def lr_scheduler(self) -> Any:
        return self.schedule.scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        self.schedule.scheduler = scheduler

    @property
    def training_dataloader(self) -> Any:
        """The loader of ``initialize(training_data=...)`` (None without one); its position is checkpointed."""
        return self.loader_position.loader

    @training_dataloader.setter
    def training_dataloader(self, loader: Any) -> None:
        self.loader_position.loader = self.data_efficiency.data_sampler.loader = loader
