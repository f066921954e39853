"""The engine's data loader (``engine.deepspeed_io``): micro-batches for one data-parallel rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler


def loader(dataset: Any, *, batch_size: int, num_replicas: int, rank: int, drop_last: bool, pin_memory: bool,
           data_sampler: Any, collate_fn: Callable | None, num_workers: int) -> DataLoader:
    """A `DataLoader` of ``dataset`` whose sampler (``data_sampler``, else a `DistributedSampler`
    over ``num_replicas`` ranks, shuffled with seed 0 as DeepSpeed's) gives this ``rank`` its share."""
    if not isinstance(dataset, torch.utils.data.Dataset):
        raise ValueError(f"training_data must be a torch.utils.data.Dataset, got {type(dataset).__name__}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"deepspeed_io: batch_size must be a positive integer, got {batch_size!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"deepspeed_io: num_local_io_workers must be an integer >= 0, got {num_workers!r}")
    if data_sampler is None:
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise ValueError("training_data is an IterableDataset, which a sampler cannot split between "
                             "data-parallel ranks: give each rank its own stream and build the DataLoader yourself")
        data_sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=data_sampler, collate_fn=collate_fn,
                      drop_last=drop_last, pin_memory=pin_memory and torch.cuda.is_available(),
                      num_workers=num_workers)
