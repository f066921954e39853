"""The engine's data loader (``engine.deepspeed_io``): micro-batches for one data-parallel rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

import ds_ops

from ._train_state import Restore


def pins_memory(accelerator: Any = None) -> bool:
    """Whether the engine's loaders pin their batches (``deepspeed_io(pin_memory=True)``): with a GPU
    accelerator, whose copies from pinned host memory are fast and asynchronous; not on the CPU, where
    there is nothing to copy to."""
    accelerator = ds_ops.get_accelerator() if accelerator is None else accelerator
    return accelerator.device_name() != "cpu"


def loader(dataset: Any, *, batch_size: int, num_replicas: int, rank: int, drop_last: bool, pin_memory: bool,
           data_sampler: Any, collate_fn: Callable | None, num_workers: int, shuffle: bool = True) -> DataLoader:
    """A `DataLoader` of ``dataset`` whose sampler (``data_sampler``, else a `DistributedSampler`
    over ``num_replicas`` ranks, shuffled with seed 0 as DeepSpeed's unless ``shuffle`` is false)
    gives this ``rank`` its share."""
    if not isinstance(dataset, torch.utils.data.Dataset) and not is_map_style(dataset):
        # DeepSpeed hands anything to a DataLoader: a map-style dataset of another library (a Hugging Face
        # datasets.Dataset) is not a torch Dataset and trains the same
        raise ValueError(f"training_data must be a torch.utils.data.Dataset or a map-style dataset (with __len__ and "
                         f"__getitem__, e.g. a Hugging Face datasets.Dataset), got {type(dataset).__name__}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"deepspeed_io: batch_size must be a positive integer, got {batch_size!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"deepspeed_io: num_local_io_workers must be an integer >= 0, got {num_workers!r}")
    if data_sampler is None:
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise ValueError("training_data is an IterableDataset, which a sampler cannot split between "
                             "data-parallel ranks: give each rank its own stream and build the DataLoader yourself")
        data_sampler = ResumableSampler(DistributedSampler(dataset, num_replicas=num_replicas, rank=rank,
                                                           drop_last=drop_last, shuffle=shuffle))
    return _Loader(dataset, batch_size=batch_size, sampler=data_sampler, collate_fn=collate_fn,
                      drop_last=drop_last, pin_memory=pin_memory and pins_memory(),
                      num_workers=num_workers)


def is_map_style(dataset: Any) -> bool:
    """Indexable with a length: what a sampler can split between ranks (a torch Dataset or another library's)."""
    return callable(getattr(dataset, "__getitem__", None)) and callable(getattr(dataset, "__len__", None))


class _Loader(DataLoader):
    """A `DataLoader` whose new pass draws its workers' seed from torch's global generator, as DeepSpeed's
    does (so the model's random stream, dropout, continues exactly as under DeepSpeed), except a pass
    resumed from a checkpoint: the interrupted run drew at its pass's start, before the checkpoint, and
    the random state the checkpoint restores is after that draw, so a resumed run continues bit for bit."""

    def __iter__(self):
        if isinstance(self.sampler, ResumableSampler) and self.sampler.resuming:
            self.generator = torch.Generator()  # this pass's draw leaves the global stream alone
            try:
                return super().__iter__()
            finally:
                self.generator = None
        return super().__iter__()


class ResumableSampler(torch.utils.data.Sampler):
    """A sampler that knows how far its current pass got (``state_dict``) and, loaded with that, skips
    what was consumed on its next pass: a resumed run sees the batches the interrupted one had not.
    Exact with ``num_workers=0`` (worker processes fetch indices ahead). ``set_epoch`` is forwarded."""

    def __init__(self, inner: torch.utils.data.Sampler) -> None:
        self.inner = inner
        self.epoch = 0
        self.consumed = 0  # indices handed out in the current pass
        self._skip = 0

    def __iter__(self):
        skip, self._skip = self._skip, 0
        self.consumed = skip
        for position, index in enumerate(self.inner):
            if position < skip:
                continue
            self.consumed += 1
            yield index

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def resuming(self) -> bool:
        """Whether the next pass continues one a checkpoint interrupted."""
        return self._skip > 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.set_epoch(int(state["epoch"]))
        self._skip = int(state["consumed"])


class LoaderPosition:
    """The training loader's position as a part of a checkpoint: its `ResumableSampler`'s state (None for any
    other loader), restored only on the world size it was saved on (a position in another world size's split of
    the data means nothing there)."""

    restore = Restore.SAME_WORLD

    def __init__(self, loader: Any = None) -> None:
        self.loader = loader

    def state_dict(self) -> dict | None:
        sampler = getattr(self.loader, "sampler", None)
        return sampler.state_dict() if isinstance(sampler, ResumableSampler) else None

    def load_state_dict(self, state: dict | None) -> None:
        sampler = getattr(self.loader, "sampler", None)
        if state is not None and isinstance(sampler, ResumableSampler):
            sampler.load_state_dict(state)


class RepeatingLoader:
    """DeepSpeed's ``RepeatingLoader``: iterates ``loader`` without end, starting it again each time it is
    exhausted (a pipeline's ``train_batch`` pulls its micro-batches from one). A loader that yields
    nothing at all raises ``StopIteration`` rather than looping forever."""

    def __init__(self, loader: Any):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
