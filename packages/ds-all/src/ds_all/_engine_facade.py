"""`PartsFacade`: DeepSpeed's engine attributes that are state of a part, as properties forwarding to the part.

DeepSpeed's scripts read and assign ``engine.global_steps``, ``engine.lr_scheduler``, ``engine.training_dataloader``
and the like; in ds the counters are `TrainState`'s and each feature's objects its part's, so these names forward
to the part that owns the value (the engine, `DeepSpeedEngine`, builds the parts: ``train_state``,
``data_efficiency``, ``schedule``, ``loader_position``, ``parallel_groups``, ``moe_wiring``). Kept apart from the
composition root so that it stays a composition.

`PART_NAMES`, the names of these parts, are the engine's own: the engine's ``__getattr__`` never looks them up on the
model (a part read before it is built is an error, not the model's attribute of that name), nor the names of these
properties (one whose part lacks what it reads raises the part's AttributeError).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._checkpoint import ScheduleState
    from ._data import LoaderPosition
    from ._data_efficiency import DataEfficiency
    from ._moe import MoEWiring
    from ._parallel import ParallelGroups
    from ._train_state import TrainState


def _forwarded(part: str, name: str, doc: str) -> property:
    """A property: the engine's ``name`` is its part ``part``'s ``name``, read and assigned there (DeepSpeed's
    engine attributes are plain attributes, and a script may assign one)."""
    def get(self: Any) -> Any:
        return getattr(getattr(self, part), name)

    def set_(self: Any, value: Any) -> None:
        setattr(getattr(self, part), name, value)

    get.__name__ = set_.__name__ = name
    return property(get, set_, doc=doc)


class PartsFacade:
    """DeepSpeed's names for state the engine's parts own (see the module docstring)."""

    train_state: TrainState
    data_efficiency: DataEfficiency
    schedule: ScheduleState
    loader_position: LoaderPosition
    parallel_groups: ParallelGroups
    moe_wiring: MoEWiring
    PART_NAMES = frozenset(("train_state", "data_efficiency", "schedule", "loader_position", "parallel_groups",
                            "moe_wiring"))

    # the process groups (`_parallel.ParallelGroups`)
    mpu = _forwarded("parallel_groups", "mpu", "The model-parallel unit of `initialize` (None without one).")
    data_parallel_group = _forwarded("parallel_groups", "data_parallel_group",
                                     "The data-parallel process group (the world's without an mpu).")
    dp_world_size = _forwarded("parallel_groups", "dp_world_size", "The data-parallel world size.")
    mp_world_size = _forwarded("parallel_groups", "mp_world_size", "The model-parallel world size (1 without an mpu).")
    sequence_parallel_size = _forwarded("parallel_groups", "sequence_parallel_size",
                                        "The sequence-parallel (Ulysses) size (1: none).")
    seq_parallel_group = _forwarded("parallel_groups", "seq_parallel_group",
                                    "The sequence-parallel group (None without sequence parallelism).")
    seq_data_parallel_group = _forwarded("parallel_groups", "seq_data_parallel_group",
                                         "The data × sequence group ZeRO partitions over (the data-parallel group "
                                         "without sequence parallelism).")
    seq_dp_world_size = _forwarded("parallel_groups", "seq_dp_world_size", "The size of `seq_data_parallel_group`.")
    checkpoint_mp_rank = _forwarded("parallel_groups", "checkpoint_mp_rank",
                                    "The model-parallel rank this rank's checkpoint files are named by.")
    # the MoE layers and their expert groups (`_moe.MoEWiring`)
    has_moe_layers = _forwarded("moe_wiring", "has_moe_layers", "Whether the model holds ds_moe.MoE layers.")
    num_experts = _forwarded("moe_wiring", "num_experts", "Each MoE layer's number of experts.")
    moe_layers = _forwarded("moe_wiring", "moe_layers", "The model's MOELayers.")
    gate_modules = _forwarded("moe_wiring", "gate_modules", "The model's TopKGates.")
    expert_parallel_group = _forwarded("moe_wiring", "expert_parallel_group",
                                       "{expert group name: this rank's expert-parallel group}.")
    expert_data_parallel_group = _forwarded("moe_wiring", "expert_data_parallel_group",
                                            "{expert group name: this rank's expert-data-parallel group}.")

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
