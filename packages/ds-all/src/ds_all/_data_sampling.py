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
from typing import Any

import torch
from torch.utils.data import DataLoader

from ds_data import DataSampler

from . import _data
from ._train_state import Restore

SECTION = "data_efficiency.data_sampling.curriculum_learning"


def enabled(config: Any) -> bool:
    """DeepSpeed's condition for its data sampler: ``curriculum_learning.enabled`` of ``data_sampling``."""
    return config.data_efficiency.data_sampling.curriculum_learning.enabled


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


def loader(config: Any, dataset: Any, *, batch_size: int | None, dp_rank: int, dp_world_size: int,
           global_rank: int, pin_memory: bool, collate_fn: Callable | None) -> SamplingLoader:
    """The loader of ``deepspeed_io`` with the data sampler (see the module docstring): this data-parallel rank's
    micro-batches (``batch_size``, else the config's) of global batches of ``train_batch_size``."""
    if not _data.is_map_style(dataset) or isinstance(dataset, torch.utils.data.IterableDataset):
        raise ValueError(f"deepspeed_io: {SECTION} samples a map-style dataset (__len__, __getitem__) by index, got "
                         f"{type(dataset).__name__}")
    section = config.data_efficiency
    sampling = section.data_sampling
    micro = batch_size if batch_size is not None else config.train_micro_batch_size_per_gpu
    sampler = DataSampler(
        len(dataset), sampling.num_epochs, micro, dp_rank, dp_world_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps, global_rank=global_rank,
        drop_last=config.dataloader_drop_last, curriculum_metrics=sampling.curriculum_learning.curriculum_metrics,
        seed=section.seed, global_batch_size=config.train_batch_size if batch_size is None else None)
    return SamplingLoader(dataset, sampler, collate_fn=collate_fn, num_workers=sampling.num_workers,
                          pin_memory=pin_memory and _data.pins_memory())


def _training_sampler(config: Any, loader_: Any, call: str) -> DataSampler:
    if not enabled(config):
        raise RuntimeError(f"engine.{call}: {SECTION} is off (the engine's loader has no data sampler)")
    if not isinstance(loader_, SamplingLoader):
        raise RuntimeError(f"engine.{call}: the engine has no training loader with the data sampler (pass "
                           "training_data to initialize)")
    return loader_.data_sampler


def set_post_process(config: Any, loader_: Any, post_process_func: Callable | None) -> None:
    """DeepSpeed's ``set_data_post_process_func``: ``fn(batch, sampler_state)`` on each batch of the training
    loader ``loader_``."""
    if post_process_func is not None and not callable(post_process_func):
        raise ValueError(f"set_data_post_process_func: post_process_func must be callable (batch, sampler state) "
                         f"or None, got {type(post_process_func).__name__}")
    _training_sampler(config, loader_, "set_data_post_process_func")
    loader_.post_process_func = post_process_func


def set_custom_schedule(config: Any, loader_: Any, schedule_func_dict: Mapping[str, Callable[[int], int]]) -> None:
    """DeepSpeed's ``set_custom_curriculum_learning_schedule``: ``{metric: fn(step) -> difficulty}`` for the
    metrics whose ``schedule_type`` is ``custom``."""
    if not isinstance(schedule_func_dict, Mapping) or not all(callable(f) for f in schedule_func_dict.values()):
        raise ValueError("set_custom_curriculum_learning_schedule: schedule_func_dict must map metric names to "
                         f"functions of the step, got {schedule_func_dict!r}")
    _training_sampler(config, loader_, "set_custom_curriculum_learning_schedule") \
        .set_custom_curriculum_learning_schedule(schedule_func_dict)


class SamplerPosition:
    """The training loader's data sampler as a part of a checkpoint (every rank's state is the same: each draws
    the global batch); nothing to save or restore when the loader has no data sampler."""

    restore = Restore.RUN

    def __init__(self, loader_: Any = None) -> None:
        self.loader = loader_

    @staticmethod
    def pipeline_refusal(config: Any, module: Any) -> Exception | None:
        """Why a `PipelineEngine` cannot train with the data sampler (None: it is off)."""
        if not enabled(config):
            return None
        return NotImplementedError("data_efficiency.data_sampling.curriculum_learning with a PipelineModule is not "
                                   "implemented in ds-all: the pipeline's loader reads its data-parallel share in "
                                   "order; build the loader with ds_data.DataSampler and set_dataloader")

    def state_dict(self) -> dict[str, Any] | None:
        return self.loader.data_sampler.state_dict() if isinstance(self.loader, SamplingLoader) else None

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        if saved is not None and isinstance(self.loader, SamplingLoader):
            self.loader.data_sampler.load_state_dict(saved)
            self.loader.mark_resumed()
