"""Variable batch size and learning rate (DeepSpeed's ``variable_batch_size_and_lr``, the
``data_efficiency.data_sampling.dynamic_batching`` section).

Samples are packed by token count: `batch_by_seqlens` walks the samples (in dataloader, random or ascending
length order), packs consecutive ones into micro-batches of at most ``max_tokens`` tokens (the sum of their
lengths) and ``min_batch_size`` to ``max_batch_size`` samples, and groups every ``effective_batch_size``
consecutive micro-batches into one batch (one optimizer step: ``train_micro_batch_size_per_gpu *
gradient_accumulation_steps * data-parallel size`` micro-batches; under DeepSpeed's engine each "sample" of
``train_micro_batch_size_per_gpu`` is one packed micro-batch). Batches hold different numbers of samples, so
the learning rate is scaled per batch (`scale_lr`: linear, sqrt or none, against ``base_batch_size``) by
`VariableBatchSizeLR`, which wraps a scheduler (or a constant rate) and, at each step, multiplies the wrapped
scheduler's rate by the scale of the next batch.

`dataloader_for_variable_batch_size` gives data-parallel rank ``r`` of ``R`` the micro-batches ``r, r + R,
...`` (a `DistributedSampler` in order): with ``effective_batch_size`` a multiple of ``R *
dataloader_batch_size``, the ranks' loaders, read ``gradient_accumulation_steps`` items each per step, cover
each batch exactly once, disjointly. Every rank computes the same batches (no communication): the order is
deterministic per ``seed``.
"""

from __future__ import annotations

import logging
import math
import os
import random
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, DistributedSampler

from ._analyzer import DataAnalyzer
from ._indexed import MMapIndexedDataset
from .config import DataEfficiencyConfig

logger = logging.getLogger(__name__)

SEQUENCE_PICKING_ORDERS = ("dataloader", "random", "seqlen")
LR_SCALING_METHODS = ("linear", "sqrt", "none")
_DYNAMIC = "data_efficiency.data_sampling.dynamic_batching"


def _int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _picking_order(value: Any) -> str:
    if value not in SEQUENCE_PICKING_ORDERS:
        raise ValueError(f"sequence_picking_order must be one of {', '.join(map(repr, SEQUENCE_PICKING_ORDERS))}, "
                         f"got {value!r}")
    return value


def _scaling_method(method: Any) -> str:
    if method is None or (isinstance(method, str) and method.lower() == "none"):
        return "none"
    if method not in ("linear", "sqrt"):
        raise ValueError(f"lr_scaling_method must be one of {', '.join(map(repr, LR_SCALING_METHODS))} (or None), "
                         f"got {method!r}")
    return method


def batch_by_seqlens(seqlens: Sequence[int], max_tokens: int, sequence_ids_per_mb: Sequence[int] | None = None,
                     min_batch_size: int = 1, max_batch_size: int | None = None,
                     sequence_picking_order: str = "dataloader", effective_batch_size: int = 1,
                     required_microbatches_of_same_size: bool = False, verbose: bool = False,
                     seed: int | None = None) -> tuple[list[tuple[int, list[int]]], list[int], list[int]]:
    """Pack samples into micro-batches of at most ``max_tokens`` tokens, grouped into batches.

    ``seqlens[i]`` is sample ``i``'s length (tokens); ``sequence_ids_per_mb`` the samples to use (all when
    None). The samples are taken in ``sequence_picking_order``: ``"dataloader"`` (as given), ``"random"``
    (``random.Random(seed).shuffle``; ``seed`` None is 0) or ``"seqlen"`` (ascending length, ties by index).
    Samples longer than ``max_tokens`` are left out (a warning names them). Consecutive samples are packed
    greedily into the longest run whose micro-batches each hold ``min_batch_size`` to ``max_batch_size``
    (None: no limit) samples and at most ``max_tokens`` tokens. With ``required_microbatches_of_same_size`` a
    run is split into ``effective_batch_size`` interleaved micro-batches of equal size (run[b::k]); else each
    run is one micro-batch. A sample that cannot start a valid run is left out (a warning); the tail that is
    too short is dropped, and so are the micro-batches after the last multiple of ``effective_batch_size``.

    Returns ``(microbatch_ids, batch_sizes, batch_max_seqlens)``: ``(batch_id, [sample ids])`` per
    micro-batch, ``effective_batch_size`` consecutive ones per batch; each batch's number of samples; each
    batch's longest sample.
    """
    max_tokens = _int(max_tokens, "batch_by_seqlens: max_tokens", 1)
    min_batch_size = _int(min_batch_size, "batch_by_seqlens: min_batch_size", 1)
    if max_batch_size is not None:
        max_batch_size = _int(max_batch_size, "batch_by_seqlens: max_batch_size", min_batch_size)
    effective_batch_size = _int(effective_batch_size, "batch_by_seqlens: effective_batch_size", 1)
    sequence_picking_order = _picking_order(sequence_picking_order)
    lengths = np.asarray(seqlens).reshape(len(seqlens), -1)[:, 0] if len(seqlens) else np.zeros(0, dtype=np.int64)
    if not np.issubdtype(lengths.dtype, np.integer) or (lengths < 0).any():
        raise ValueError(f"batch_by_seqlens: seqlens must be integers >= 0, got {lengths.dtype} values "
                         f"{lengths[:8].tolist()}...")
    ids = range(len(lengths)) if sequence_ids_per_mb is None else [int(i) for i in sequence_ids_per_mb]
    bad = [i for i in ids if not 0 <= i < len(lengths)]
    if bad:
        raise ValueError(f"batch_by_seqlens: sequence_ids_per_mb {bad[:8]} out of range: samples are 0 to "
                         f"{len(lengths) - 1}")
    metrics = [(int(lengths[i]), int(i)) for i in ids]
    if sequence_picking_order == "random":
        random.Random(0 if seed is None else seed).shuffle(metrics)
    elif sequence_picking_order == "seqlen":
        metrics.sort()
    long_ids = [i for length, i in metrics if length > max_tokens]
    if long_ids:
        logger.warning("batch_by_seqlens: samples %s left out: longer than max_tokens %d", long_ids, max_tokens)
        metrics = [m for m in metrics if m[0] <= max_tokens]

    k = effective_batch_size if required_microbatches_of_same_size else 1
    microbatches: list[list[tuple[int, int]]] = []
    start, n = 0, len(metrics)
    while start < n:
        best, end, sums, over = None, start, [0] * k, False
        while end + k <= n:  # the run grows by one sample per micro-batch
            for b in range(k):
                sums[b] += metrics[end + b][0]
            end += k
            size = (end - start) // k
            if max(sums) > max_tokens or (max_batch_size is not None and size > max_batch_size):
                over = True
                break
            if size >= min_batch_size:
                best = end
        if best is None:
            if not over:
                break  # too few samples left for a run
            logger.warning("batch_by_seqlens: sample %d left out: no micro-batch of %d to %s samples and at most "
                           "%d tokens starts with it", metrics[start][1], min_batch_size, max_batch_size, max_tokens)
            start += 1
            continue
        run = metrics[start:best]
        microbatches += [run[b::k] for b in range(k)]
        start = best
    if n - start:
        logger.info("batch_by_seqlens: the last %d samples left out (too few for a micro-batch)", n - start)

    if len(microbatches) < effective_batch_size:
        raise ValueError(f"batch_by_seqlens: only {len(microbatches)} micro-batches from {n} samples, fewer than "
                         f"effective_batch_size {effective_batch_size} (one per micro-batch of a batch)")
    microbatches = microbatches[:len(microbatches) - len(microbatches) % effective_batch_size]

    microbatch_ids: list[tuple[int, list[int]]] = []
    batch_sizes: list[int] = []
    batch_max_seqlens: list[int] = []
    for batch_id, first in enumerate(range(0, len(microbatches), effective_batch_size)):
        mbs = microbatches[first:first + effective_batch_size]
        batch_sizes.append(sum(len(mb) for mb in mbs))
        batch_max_seqlens.append(max(length for mb in mbs for length, _ in mb))
        microbatch_ids += [(batch_id, [i for _, i in mb]) for mb in mbs]
        if verbose:
            logger.info("batch %d: %d micro-batches, %d samples; samples per micro-batch %s, tokens per micro-batch "
                        "%s, sample ids %s, lengths %s", batch_id, len(mbs), batch_sizes[-1],
                        [len(mb) for mb in mbs], [sum(x for x, _ in mb) for mb in mbs],
                        [[i for _, i in mb] for mb in mbs], [[x for x, _ in mb] for mb in mbs])
    return microbatch_ids, batch_sizes, batch_max_seqlens


def scale_lr(base_batch_size: float, batch_size: float, base_lr: float = 1, method: str | None = "linear") -> float:
    """The learning rate for ``batch_size`` given ``base_lr`` at ``base_batch_size``: ``"linear"``, ``base_lr *
    batch_size / base_batch_size`` (Goyal et al.); ``"sqrt"``, ``base_lr * sqrt(batch_size / base_batch_size)``
    (Krizhevsky); ``"none"`` (or None), ``base_lr``."""
    method = _scaling_method(method)
    if not base_batch_size > 0:
        raise ValueError(f"scale_lr: base_batch_size must be > 0, got {base_batch_size!r}")
    if not batch_size >= 0:
        raise ValueError(f"scale_lr: batch_size must be >= 0, got {batch_size!r}")
    if method == "linear":
        return base_lr * batch_size / base_batch_size
    if method == "sqrt":
        return base_lr * math.sqrt(batch_size / base_batch_size)
    return base_lr


class _VariableBatchCollate:
    """The loader's collate: the samples of the micro-batches of one loader item, optionally padded to their
    batch's longest sample, then the user's collate (or the list)."""

    def __init__(self, dataset: Any, batch_max_seqlens: Sequence[int], collate_fn: Callable | None,
                 padding_fn: Callable | None, pad: bool) -> None:
        self.dataset, self.batch_max_seqlens = dataset, batch_max_seqlens
        self.collate_fn, self.padding_fn, self.pad = collate_fn, padding_fn, pad

    def __call__(self, items: list[tuple[int, list[int]]]) -> Any:
        batch = []
        for batch_id, sample_ids in items:
            samples = [self.dataset[i] for i in sample_ids]
            if self.pad:
                samples = [self.padding_fn(s, self.batch_max_seqlens[batch_id]) for s in samples]
            batch += samples
        return self.collate_fn(batch) if self.collate_fn is not None else batch


def dataloader_for_variable_batch_size(dataset: Any, microbatch_ids: Sequence[tuple[int, list[int]]],
                                       batch_max_seqlens: Sequence[int], dataloader_rank: int = 0,
                                       dataloader_batch_size: int = 1, dataloader_num_replicas: int = 1,
                                       dataloader_collate_fn: Callable | None = None,
                                       dataloader_num_workers: int = 2, dataloader_pin_memory: bool = False,
                                       required_microbatches_of_same_seqlen: bool = False,
                                       sample_padding_fn: Callable | None = None
                                       ) -> tuple[DataLoader, dict[str, Any]]:
    """Rank ``dataloader_rank``'s loader of `batch_by_seqlens`'s micro-batches (``r, r + R, ...`` in order),
    ``dataloader_batch_size`` micro-batches' samples per item, collated by ``dataloader_collate_fn`` (a list
    without one). With ``required_microbatches_of_same_seqlen`` each sample is first passed through
    ``sample_padding_fn(sample, length)`` with its batch's longest length. Returns the loader and the keyword
    arguments of the engine's ``deepspeed_io`` that build the same loader."""
    replicas = _int(dataloader_num_replicas, "dataloader_num_replicas", 1)
    rank = _int(dataloader_rank, "dataloader_rank", 0)
    if rank >= replicas:
        raise ValueError(f"dataloader_rank must be below dataloader_num_replicas {replicas}, got {rank}")
    batch_size = _int(dataloader_batch_size, "dataloader_batch_size", 1)
    workers = _int(dataloader_num_workers, "dataloader_num_workers", 0)
    if len(microbatch_ids) % replicas:
        raise ValueError(f"dataloader_for_variable_batch_size: {len(microbatch_ids)} micro-batches do not split "
                         f"evenly over dataloader_num_replicas {replicas}")
    if required_microbatches_of_same_seqlen and sample_padding_fn is None:
        raise ValueError("required_microbatches_of_same_seqlen needs sample_padding_fn (got None)")
    microbatch_ids = list(microbatch_ids)
    sampler = DistributedSampler(microbatch_ids, num_replicas=replicas, rank=rank, shuffle=False, drop_last=False)
    collate = _VariableBatchCollate(dataset, batch_max_seqlens, dataloader_collate_fn, sample_padding_fn,
                                    required_microbatches_of_same_seqlen)
    loader = DataLoader(microbatch_ids, batch_size=batch_size, sampler=sampler, num_workers=workers,
                        collate_fn=collate, pin_memory=dataloader_pin_memory)
    io_kwargs = {"dataset": microbatch_ids, "batch_size": batch_size, "pin_memory": dataloader_pin_memory,
                 "data_sampler": sampler, "collate_fn": collate, "num_local_io_workers": workers}
    return loader, io_kwargs


class VariableBatchSizeLR(LRScheduler):
    """A scheduler that scales another's learning rate by each batch's size.

    At step ``t`` (``step()`` after each optimizer step; the constructor does ``step(0)``) the wrapped
    scheduler steps on its own, unscaled, rates, and each group's rate becomes ``scale_lr(base_batch_size,
    batch_sizes[t % len(batch_sizes)], <wrapped rate>, lr_scaling_method)``. ``step(0)`` resets the wrapped
    scheduler to its first rates and the batches to the first (the start of an epoch). As DeepSpeed's,
    ``get_last_lr()`` is the wrapped scheduler's unscaled rates and ``get_lr()`` the optimizer's (scaled)
    ones. ``dataloader`` is kept as ``self.dataloader``."""

    @property
    def optimizer(self) -> Optimizer:
        return self.base_lr_scheduler.optimizer

    def __init__(self, lr_scheduler: Any, base_batch_size: int, batch_sizes: Sequence[int], dataloader: Any,
                 lr_scaling_method: str | None = "linear", last_epoch: int = -1, verbose: bool = False) -> None:
        if not base_batch_size > 0:
            raise ValueError(f"VariableBatchSizeLR: base_batch_size must be > 0, got {base_batch_size!r}")
        if len(batch_sizes) == 0 or any(not b >= 0 for b in batch_sizes):
            raise ValueError(f"VariableBatchSizeLR: batch_sizes must be a non-empty list of sizes >= 0, got "
                             f"{list(batch_sizes)[:8]}")
        self.lr_scaling_method = _scaling_method(lr_scaling_method)
        self.batch_sizes = [int(b) for b in batch_sizes]
        self.base_batch_size = base_batch_size
        self.dataloader = dataloader
        self.base_lr_scheduler = lr_scheduler
        self.base_lrs = list(self._unscaled())
        self.last_epoch = last_epoch
        self.verbose = verbose
        self.step(0)

    def _unscaled(self) -> list[float]:
        last = getattr(self.base_lr_scheduler, "get_last_lr", None)
        lrs = last() if callable(last) else None
        return list(lrs) if lrs is not None else [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"base_lr_scheduler": self.base_lr_scheduler.state_dict(), "base_batch_size": self.base_batch_size,
                "lr_scaling_method": self.lr_scaling_method, "batch_sizes": list(self.batch_sizes),
                "base_lrs": list(self.base_lrs), "last_epoch": self.last_epoch, "verbose": self.verbose}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.base_lr_scheduler.load_state_dict(state_dict["base_lr_scheduler"])
        self.base_batch_size = state_dict["base_batch_size"]
        self.lr_scaling_method = _scaling_method(state_dict["lr_scaling_method"])
        self.batch_sizes = list(state_dict["batch_sizes"])
        self.base_lrs = list(state_dict["base_lrs"])
        self.last_epoch = state_dict["last_epoch"]
        self.verbose = state_dict["verbose"]

    def get_last_lr(self) -> list[float]:
        return self._unscaled()

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def current_batch_size(self) -> int:
        """The size of the batch the optimizer's rates are scaled for now."""
        return self.batch_sizes[self.last_epoch % len(self.batch_sizes)]

    def step(self, epoch: int | None = None) -> None:
        unscaled = self.base_lrs if epoch == 0 else self._unscaled()
        for group, lr in zip(self.optimizer.param_groups, unscaled, strict=True):
            group["lr"] = lr  # the wrapped scheduler steps from its own rates
        if epoch is None:
            self.base_lr_scheduler.step()
        else:  # a reset: torch's warnings about the epoch argument and the step order are expected here
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*epoch parameter in `scheduler.step\\(\\)`")
                warnings.filterwarnings("ignore", message=".*`lr_scheduler.step\\(\\)` before `optimizer.step")
                self.base_lr_scheduler.step(epoch)
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        batch_size = self.current_batch_size()
        for group in self.optimizer.param_groups:
            group["lr"] = scale_lr(self.base_batch_size, batch_size, group["lr"], self.lr_scaling_method)
        if self.verbose:
            logger.info("batch %d: batch size %d (reference %s), lr %s -> %s", self.last_epoch, batch_size,
                        self.base_batch_size, unscaled, self.get_lr())


class _ConstantLR(LRScheduler):
    """The optimizer's rates, unchanged (what `VariableBatchSizeLR` wraps when given an optimizer)."""

    def get_lr(self) -> list[float]:
        return list(self.base_lrs)


def lr_scheduler_for_variable_batch_size(base_batch_size: int, batch_sizes: Sequence[int], dataloader: Any,
                                         lr_scheduler_or_optimizer: Any, lr_scaling_method: str | None = "linear",
                                         verbose: bool = False) -> VariableBatchSizeLR:
    """A `VariableBatchSizeLR` over a scheduler (anything with ``.optimizer`` and ``step``), or over an
    optimizer's constant rates (a torch optimizer, or a wrapper of one such as the engine's)."""
    obj = lr_scheduler_or_optimizer
    inner = getattr(obj, "optimizer", None)
    if isinstance(obj, Optimizer):
        scheduler = _ConstantLR(obj)
    elif isinstance(inner, Optimizer) and hasattr(obj, "zero_grad"):  # an optimizer wrapper, not a scheduler
        scheduler = _ConstantLR(inner)
    elif isinstance(inner, Optimizer) and hasattr(obj, "step"):
        scheduler = obj
    else:
        raise ValueError(f"lr_scheduler_or_optimizer must be a torch Optimizer, a wrapper of one, or a scheduler "
                         f"with an .optimizer; got {type(obj).__name__}")
    return VariableBatchSizeLR(scheduler, base_batch_size, batch_sizes, dataloader, lr_scaling_method,
                               verbose=verbose)


def get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset: Any, dataset_seqlens: Sequence[int], max_tokens: int, effective_batch_size: int,
        dataset_filter_ids: Sequence[int] | None = None, lr_scaling_method: str | None = "linear",
        min_batch_size: int = 1, max_batch_size: int | None = None, sequence_picking_order: str = "dataloader",
        dataloader_batch_size: int = 1, dataloader_rank: int = 0, dataloader_num_replicas: int = 1,
        dataloader_num_workers: int = 0, dataloader_collate_fn: Callable | None = None,
        dataloader_pin_memory: bool = False, lr_scheduler_or_optimizer: Any = None,
        required_microbatches_of_same_size: bool = False, required_microbatches_of_same_seqlen: bool = False,
        sample_padding_fn: Callable | None = None, verbose: bool = False, seed: int | None = None
) -> tuple[DataLoader, VariableBatchSizeLR, dict[str, Any]]:
    """`batch_by_seqlens`, then this rank's loader and the scheduler scaled against ``effective_batch_size``
    (micro-batches per batch: ``dataloader_batch_size * gradient_accumulation_steps * dataloader_num_replicas``,
    so a multiple of ``dataloader_batch_size * dataloader_num_replicas``)."""
    per_item = _int(dataloader_batch_size, "dataloader_batch_size", 1) * \
        _int(dataloader_num_replicas, "dataloader_num_replicas", 1)
    if _int(effective_batch_size, "effective_batch_size", 1) % per_item:
        raise ValueError(f"effective_batch_size {effective_batch_size} must be a multiple of dataloader_batch_size "
                         f"* dataloader_num_replicas = {per_item} (a batch is micro-batch size x gradient "
                         "accumulation steps x data-parallel ranks micro-batches)")
    microbatch_ids, batch_sizes, batch_max_seqlens = batch_by_seqlens(
        dataset_seqlens, max_tokens, sequence_ids_per_mb=dataset_filter_ids, min_batch_size=min_batch_size,
        max_batch_size=max_batch_size, sequence_picking_order=sequence_picking_order,
        effective_batch_size=effective_batch_size,
        required_microbatches_of_same_size=required_microbatches_of_same_size, verbose=verbose, seed=seed)
    loader, io_kwargs = dataloader_for_variable_batch_size(
        dataset, microbatch_ids, batch_max_seqlens, dataloader_rank=dataloader_rank,
        dataloader_batch_size=dataloader_batch_size, dataloader_num_replicas=dataloader_num_replicas,
        dataloader_collate_fn=dataloader_collate_fn, dataloader_num_workers=dataloader_num_workers,
        dataloader_pin_memory=dataloader_pin_memory,
        required_microbatches_of_same_seqlen=required_microbatches_of_same_seqlen,
        sample_padding_fn=sample_padding_fn)
    scheduler = lr_scheduler_for_variable_batch_size(effective_batch_size, batch_sizes, loader,
                                                     lr_scheduler_or_optimizer, lr_scaling_method, verbose=verbose)
    return loader, scheduler, io_kwargs


def _data_efficiency(engine: Any) -> DataEfficiencyConfig:
    section = getattr(getattr(engine, "config", None), "data_efficiency", None)
    if isinstance(section, DataEfficiencyConfig):
        return section
    getter = getattr(engine, "data_efficiency_config", None)
    raw = getter() if callable(getter) else getattr(getattr(engine, "_config", None), "data_efficiency_config", None)
    if raw is None:
        raise ValueError(f"engine {type(engine).__name__} has no data_efficiency config")
    return raw if isinstance(raw, DataEfficiencyConfig) else DataEfficiencyConfig.model_validate(raw)


def _dp_rank_and_size(engine: Any) -> tuple[int, int]:
    group = getattr(engine, "data_parallel_group", None)
    if callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None)):
        return int(group.rank()), int(group.size())
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    return 0, 1


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _seqlens_from_metrics(dataset: Any, engine: Any, metrics_path: str | None, collate_fn: Callable | None,
                          batch_seqlens_fn: Callable | None) -> np.ndarray:
    if metrics_path is None:
        raise ValueError(f"{_DYNAMIC}.metrics_path is needed when dataset_seqlens is not given")
    prefix = os.path.join(metrics_path, "seqlen", "seqlen_sample_to_metric")
    if not MMapIndexedDataset.exists(prefix):
        if batch_seqlens_fn is None:
            raise ValueError(f"no sequence-length metric at {prefix}.idx/.bin: give dataset_seqlens or "
                             "batch_seqlens_fn (got neither)")
        logger.warning("no sequence-length metric at %s: running the data analyzer with batch_seqlens_fn", prefix)
        world = int(getattr(engine, "world_size", 1) or 1)
        rank = int(getattr(engine, "global_rank", 0) or 0)
        analyzer = DataAnalyzer(dataset, ["seqlen"], [batch_seqlens_fn], ["single_value_per_sample"], [np.int64],
                                metrics_path, num_workers=world, worker_id=rank, batch_size=1024,
                                collate_fn=collate_fn)
        analyzer.run_map()
        _barrier()
        if rank == 0:
            analyzer.run_reduce()
        _barrier()
    metric = MMapIndexedDataset(prefix)
    if len(metric) != len(dataset):
        raise ValueError(f"{prefix} holds {len(metric)} sequence lengths, the dataset {len(dataset)} samples "
                         f"(delete {metrics_path} if the dataset changed)")
    return np.asarray(metric.flat(), dtype=np.int64).reshape(len(metric))


def get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset: Any, engine: Any, dataset_seqlens: Sequence[int] | None = None,
        dataset_filter_ids: Sequence[int] | None = None, dataloader_collate_fn: Callable | None = None,
        sample_padding_fn: Callable | None = None, batch_seqlens_fn: Callable | None = None
) -> tuple[DataLoader, VariableBatchSizeLR, dict[str, Any]]:
    """`get_dataloader_and_lr_scheduler_for_variable_batch_size` from an engine's config (the
    ``dynamic_batching`` keys, ``data_efficiency.seed``, ``data_sampling.num_workers``/``pin_memory``) and
    sizes: ``effective_batch_size = train_batch_size()`` micro-batches per step, ``train_micro_batch_size_per_gpu()``
    micro-batches per loader item, its data-parallel rank, the rate of ``engine.lr_scheduler`` (else of
    ``engine.optimizer``), equal micro-batch sizes and padding for a pipeline engine. The lengths:
    ``dataset_seqlens``, else the analyzer's ``<metrics_path>/seqlen/seqlen_sample_to_metric``, written first
    (by every rank's share) with ``batch_seqlens_fn`` when missing. Set ``engine.lr_scheduler`` to the scheduler
    returned."""
    config = _data_efficiency(engine)
    batching = config.data_sampling.dynamic_batching
    if not batching.enabled:
        raise ValueError(f"{_DYNAMIC}.enabled is false: enable dynamic batching in the config to use it")
    if dataset_seqlens is None:
        dataset_seqlens = _seqlens_from_metrics(dataset, engine, batching.metrics_path, dataloader_collate_fn,
                                                batch_seqlens_fn)
    rank, size = _dp_rank_and_size(engine)
    pipeline = any(cls.__name__ == "PipelineEngine" for cls in type(engine).__mro__)
    return get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset=dataset, dataset_seqlens=dataset_seqlens, dataset_filter_ids=dataset_filter_ids,
        effective_batch_size=engine.train_batch_size(), max_tokens=batching.max_tokens,
        lr_scaling_method=batching.lr_scaling_method, sequence_picking_order=batching.sequence_picking_order,
        min_batch_size=batching.min_batch_size, max_batch_size=batching.max_batch_size,
        dataloader_batch_size=engine.train_micro_batch_size_per_gpu(), dataloader_rank=rank,
        dataloader_num_replicas=size, dataloader_num_workers=config.data_sampling.num_workers,
        dataloader_collate_fn=dataloader_collate_fn, dataloader_pin_memory=config.data_sampling.pin_memory,
        sample_padding_fn=sample_padding_fn, lr_scheduler_or_optimizer=engine.lr_scheduler or engine.optimizer,
        required_microbatches_of_same_size=pipeline, required_microbatches_of_same_seqlen=pipeline,
        verbose=batching.verbose, seed=config.seed)
