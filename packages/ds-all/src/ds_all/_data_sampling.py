"""The engine's data sampler: ``data_efficiency.data_sampling.curriculum_learning`` (DeepSpeed's
``DeepSpeedDataLoader`` with its ``DeepSpeedDataSampler``).

As DeepSpeed's engine, ``deepspeed_io`` (and so ``initialize(training_data=...)``) builds the loader with a
`ds_data.DataSampler` as its batch sampler when ``curriculum_learning_enabled()``: the data-parallel rank and
size, the micro-batch, ``gradient_accumulation_steps`` (a global batch of ``train_batch_size``), the section's
``seed``, ``num_epochs``, ``num_workers``, ``dataloader_drop_last`` and the curriculum metrics. The metrics'
difficulties move once per global batch; the engine passes none of them to forward (DeepSpeed 0.19.8 neither):
``set_data_post_process_func(fn)`` gets ``fn(batch, sampler.state_dict())`` for each batch, whose
``current_difficulties`` hold them (Megatron-DeepSpeed truncates its sequences there). The training loader's
sampler state goes into checkpoints with the other data-efficiency states.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

import ds_comm
from ds_data import DataSampler

from . import _data

if TYPE_CHECKING:
    from ._engine import DeepSpeedEngine

SECTION = "data_efficiency.data_sampling.curriculum_learning"


def enabled(engine: DeepSpeedEngine) -> bool:
    """DeepSpeed's condition for its data sampler: ``curriculum_learning.enabled`` of ``data_sampling``."""
    return engine.config.data_efficiency.data_sampling.curriculum_learning.enabled


class SamplingLoader(DataLoader):
    """A `DataLoader` over a `ds_data.DataSampler` (``data_sampler``, also its ``batch_sampler``), each batch
    passed through ``post_process_func(batch, data_sampler.state_dict())`` when one is set. Its sampler's
    state is where the batches it delivered end (exact with ``num_workers=0``: worker processes fetch indices
    ahead). A pass resumed from a checkpoint draws its workers' seed from a generator of its own, as
    `_data.ResumableSampler`'s loader does, so that torch's global stream continues as in the interrupted run."""

    def __init__(self, dataset: Any, sampler: DataSampler, **kwargs: Any) -> None:
        super().__init__(dataset, batch_sampler=sampler, **kwargs)
        self.post_process_func: Callable[[Any, dict[str, Any]], Any] | None = None
        self._resuming = False

    @property
    def data_sampler(self) -> DataSampler:
        """DeepSpeed's ``DeepSpeedDataLoader.data_sampler``."""
        return self.batch_sampler

    def __len__(self) -> int:
        """The micro-batches this rank gets in all (``total_samples * num_epochs`` samples)."""
        sampler = self.data_sampler
        full, rest = divmod(sampler.total_samples, sampler.micro_batch_times_data_parallel_size)
        return full + (1 if rest and not sampler.drop_last else 0)

    def __iter__(self):
        if not self._resuming:
            return self._post_processed(super().__iter__())
        self._resuming = False
        self.generator = torch.Generator()  # this pass's draw leaves the global stream alone
        try:
            return self._post_processed(super().__iter__())
        finally:
            self.generator = None

    def _post_processed(self, batches):
        for batch in batches:
            if self.post_process_func is not None:
                batch = self.post_process_func(batch, self.data_sampler.state_dict())
            yield batch

    def mark_resumed(self) -> None:
        """The sampler was loaded from a checkpoint: the next pass continues an interrupted one."""
        self._resuming = True


def loader(engine: DeepSpeedEngine, dataset: Any, *, batch_size: int | None, pin_memory: bool,
           collate_fn: Callable | None) -> SamplingLoader:
    """The loader of ``deepspeed_io`` with the data sampler (see the module docstring)."""
    if not _data.is_map_style(dataset) or isinstance(dataset, torch.utils.data.IterableDataset):
        raise ValueError(f"deepspeed_io: {SECTION} samples a map-style dataset (__len__, __getitem__) by index, got "
                         f"{type(dataset).__name__}")
    section = engine.config.data_efficiency
    sampling = section.data_sampling
    micro = batch_size if batch_size is not None else engine.train_micro_batch_size_per_gpu()
    sampler = DataSampler(
        len(dataset), sampling.num_epochs, micro, ds_comm.get_rank(engine.data_parallel_group), engine.dp_world_size,
        gradient_accumulation_steps=engine.gradient_accumulation_steps(), global_rank=engine.global_rank,
        drop_last=engine.config.dataloader_drop_last, curriculum_metrics=sampling.curriculum_learning.curriculum_metrics,
        seed=section.seed, global_batch_size=engine.train_batch_size() if batch_size is None else None)
    return SamplingLoader(dataset, sampler, collate_fn=collate_fn, num_workers=sampling.num_workers,
                          pin_memory=pin_memory and _data.pins_memory())


def _training_sampler(engine: DeepSpeedEngine, call: str) -> DataSampler:
    loader_ = engine.training_dataloader
    if not enabled(engine):
        raise RuntimeError(f"engine.{call}: {SECTION} is off (the engine's loader has no data sampler)")
    if not isinstance(loader_, SamplingLoader):
        raise RuntimeError(f"engine.{call}: the engine has no training loader with the data sampler (pass "
                           "training_data to initialize)")
    return loader_.data_sampler


def set_post_process(engine: DeepSpeedEngine, post_process_func: Callable | None) -> None:
    """DeepSpeed's ``set_data_post_process_func``: ``fn(batch, sampler_state)`` on each training batch."""
    if post_process_func is not None and not callable(post_process_func):
        raise ValueError(f"set_data_post_process_func: post_process_func must be callable (batch, sampler state) "
                         f"or None, got {type(post_process_func).__name__}")
    _training_sampler(engine, "set_data_post_process_func")
    engine.training_dataloader.post_process_func = post_process_func


def set_custom_schedule(engine: DeepSpeedEngine, schedule_func_dict: Mapping[str, Callable[[int], int]]) -> None:
    """DeepSpeed's ``set_custom_curriculum_learning_schedule``: ``{metric: fn(step) -> difficulty}`` for the
    metrics whose ``schedule_type`` is ``custom``."""
    if not isinstance(schedule_func_dict, Mapping) or not all(callable(f) for f in schedule_func_dict.values()):
        raise ValueError("set_custom_curriculum_learning_schedule: schedule_func_dict must map metric names to "
                         f"functions of the step, got {schedule_func_dict!r}")
    _training_sampler(engine, "set_custom_curriculum_learning_schedule").set_custom_curriculum_learning_schedule(
        schedule_func_dict)


def state(engine: DeepSpeedEngine) -> dict[str, Any] | None:
    """The training loader's sampler state (every rank's is the same: each draws the global batch)."""
    loader_ = engine.training_dataloader
    return loader_.data_sampler.state_dict() if isinstance(loader_, SamplingLoader) else None


def restore(engine: DeepSpeedEngine, saved: dict[str, Any] | None) -> None:
    loader_ = engine.training_dataloader
    if saved is not None and isinstance(loader_, SamplingLoader):
        loader_.data_sampler.load_state_dict(saved)
        loader_.mark_resumed()
