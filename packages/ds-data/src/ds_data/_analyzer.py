"""`DataAnalyzer`: index a dataset by difficulty metrics, map-reduce over workers (DeepSpeed's layout).

Map (`DataAnalyzer.run_map`, on every worker): worker ``w`` of ``W`` takes the ``w``-th of ``W`` contiguous
ranges of the dataset (DeepSpeed's ``split_index``), runs each metric function over its batches and
writes, under ``<save_path>/<metric>/worker<w>_thread0/``:

* ``single_value_per_sample``: ``<metric>_sample_to_metric`` (one array of one value per sample, in
  dataset order, the ``metric_dtype``);
* ``accumulate_value_over_samples``: ``<metric>_metric_value`` (one array: the sum over the worker's
  samples of what the function returned).

Reduce (`DataAnalyzer.run_reduce`, once, after every worker's map): under ``<save_path>/<metric>/``,

* ``<metric>_sample_to_metric``: the workers' files concatenated (sample ``i``'s value is array ``i``);
* ``<metric>_index_to_metric``: one array ``[v]`` per distinct value ``v``, ascending;
* ``<metric>_index_to_sample``: array ``k`` lists the sample indices whose value is the ``k``-th value,
  ascending;
* ``<metric>_index_to_sample_percentile_merged``: ``index_to_sample`` with every
  ``max(1, len // 100)`` consecutive arrays joined (DeepSpeed's file for percentile curricula);
* ``accumulate_value_over_samples``: ``<metric>_metric_value``, the sum over the workers.

Every file is `MMapIndexedDataset` (``.bin``/``.idx``), written atomically. Value and index dtypes are the
smallest integer types that hold them (DeepSpeed's ``find_fit_int_dtype``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, Subset

from ._indexed import (
    MMapIndexedDataset,
    find_fit_int_dtype,
    numpy_dtype,
    split_index,
    write_indexed,
)

logger = logging.getLogger(__name__)

METRIC_TYPES = ("single_value_per_sample", "accumulate_value_over_samples")


def _worker_dir(save_path: str, metric: str, worker: int) -> Path:
    return Path(save_path) / metric / f"worker{worker}_thread0"


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DataAnalyzer: {name} must be a positive integer, got {value!r}")
    return value


class DataAnalyzer:
    """Index ``dataset`` by ``metric_names`` (DeepSpeed's ``DataAnalyzer``).

    ``metric_functions[i](batch)`` gets a batch of ``batch_size`` samples as ``collate_fn`` (torch's
    default collation when None) makes it and returns a tensor or array of ``metric_dtypes[i]`` (an
    integer dtype of the indexed format): for ``single_value_per_sample``, one value per sample (shape
    ``(b,)`` or ``(b, 1)``); for ``accumulate_value_over_samples``, an array of any fixed shape, summed over
    the batches. ``num_workers``/``worker_id``: this process's share of the map step; `run_reduce` runs
    once after every worker's `run_map` (`run_map_reduce` does both for one worker)."""

    def __init__(self, dataset: Any, metric_names: Sequence[str], metric_functions: Sequence[Callable[[Any], Any]],
                 metric_types: Sequence[str], metric_dtypes: Sequence[Any], save_path: str | os.PathLike,
                 num_workers: int = 1, worker_id: int = 0, batch_size: int = 1,
                 collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        names = list(metric_names)
        lengths = {"metric_functions": len(metric_functions), "metric_types": len(metric_types),
                   "metric_dtypes": len(metric_dtypes)}
        if not names:
            raise ValueError("DataAnalyzer: metric_names is empty; give at least one metric")
        bad = {key: n for key, n in lengths.items() if n != len(names)}
        if bad:
            raise ValueError(f"DataAnalyzer: {len(names)} metric_names but {bad}: one entry per metric")
        for name in names:
            if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
                raise ValueError(f"DataAnalyzer: a metric name is a non-empty file name, got {name!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"DataAnalyzer: metric_names repeat a name: {names}")
        for name, kind in zip(names, metric_types, strict=True):
            if kind not in METRIC_TYPES:
                raise ValueError(f"DataAnalyzer: metric {name!r} has metric_type {kind!r}; allowed: "
                                 f"{', '.join(METRIC_TYPES)}")
        for name, fn in zip(names, metric_functions, strict=True):
            if not callable(fn):
                raise ValueError(f"DataAnalyzer: the metric function of {name!r} is not callable: {fn!r}")
        self.dtypes = [numpy_dtype(d) for d in metric_dtypes]
        self.num_workers = _positive_int(num_workers, "num_workers")
        if isinstance(worker_id, bool) or not isinstance(worker_id, int) or not 0 <= worker_id < num_workers:
            raise ValueError(f"DataAnalyzer: worker_id must be in [0, {num_workers}), got {worker_id!r}")
        self.worker_id = worker_id
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.dataset = dataset
        self.metric_names = names
        self.metric_functions = list(metric_functions)
        self.metric_types = list(metric_types)
        self.metric_dtypes = list(metric_dtypes)
        self.save_path = os.fspath(save_path)
        self.collate_fn = collate_fn

    # ------------------------------------------------------------------------------------- map
    def worker_range(self, worker_id: int | None = None) -> tuple[int, int]:
        """The dataset range ``[start, end)`` of ``worker_id`` (this worker by default)."""
        worker = self.worker_id if worker_id is None else worker_id
        return split_index(0, len(self.dataset), self.num_workers)[worker]

    def _values(self, index: int, batch: Any, rows: int) -> np.ndarray:
        name, dtype = self.metric_names[index], self.dtypes[index]
        out = self.metric_functions[index](batch)
        if isinstance(out, torch.Tensor):
            if out.dtype.is_floating_point or out.dtype.is_complex or out.dtype == torch.bool:
                raise ValueError(f"metric {name!r}: the function returned a {out.dtype} tensor; metric_dtype is "
                                 f"{dtype.name}")
            out = out.detach().cpu().numpy()
        if not isinstance(out, np.ndarray):
            raise ValueError(f"metric {name!r}: the function must return a tensor or a numpy array, got "
                             f"{type(out).__name__}")
        if out.dtype != dtype:
            raise ValueError(f"metric {name!r}: the function returned dtype {out.dtype}, metric_dtype is {dtype.name}")
        if self.metric_types[index] == "single_value_per_sample" and out.shape not in ((rows,), (rows, 1)):
            raise ValueError(f"metric {name!r} (single_value_per_sample): the function returned shape "
                             f"{tuple(out.shape)} for a batch of {rows}; expected ({rows},) or ({rows}, 1)")
        return out

    def run_map(self) -> None:
        """This worker's share: its partial files under ``<save_path>/<metric>/worker<id>_thread0/``."""
        start, end = self.worker_range()
        logger.info("data analyzer worker %d: samples %d to %d", self.worker_id, start, end)
        subset = Subset(self.dataset, list(range(start, end)))
        batches = BatchSampler(SequentialSampler(subset), batch_size=self.batch_size, drop_last=False)
        loader = DataLoader(subset, batch_sampler=batches, num_workers=0, collate_fn=self.collate_fn)
        per_sample: list[list[np.ndarray]] = [[] for _ in self.metric_names]
        sums: list[np.ndarray | None] = [None for _ in self.metric_names]
        for rows, batch in zip((len(b) for b in batches), loader, strict=True):
            for i, kind in enumerate(self.metric_types):
                values = self._values(i, batch, rows)
                if kind == "single_value_per_sample":
                    per_sample[i].append(values.reshape(-1))
                elif sums[i] is None:
                    sums[i] = values.astype(np.int64)
                elif sums[i].shape != values.shape:
                    raise ValueError(f"metric {self.metric_names[i]!r} (accumulate_value_over_samples): the "
                                     f"function returned shape {values.shape} after {sums[i].shape}")
                else:
                    sums[i] += values
        for i, (name, kind) in enumerate(zip(self.metric_names, self.metric_types, strict=True)):
            folder = _worker_dir(self.save_path, name, self.worker_id)
            folder.mkdir(parents=True, exist_ok=True)
            if kind == "single_value_per_sample":
                values = np.concatenate(per_sample[i]) if per_sample[i] else np.zeros(0, dtype=self.dtypes[i])
                write_indexed(folder / f"{name}_sample_to_metric", values.reshape(-1, 1), self.dtypes[i])
            elif sums[i] is not None:
                write_indexed(folder / f"{name}_metric_value", [sums[i].reshape(-1)], find_fit_int_dtype(
                    int(sums[i].min()), int(sums[i].max())))

    # ---------------------------------------------------------------------------------- reduce
    def run_reduce(self) -> None:
        """Merge every worker's partial files into the final ones (run once, after all maps)."""
        total = len(self.dataset)
        for name, kind in zip(self.metric_names, self.metric_types, strict=True):
            folder = Path(self.save_path) / name
            if kind == "single_value_per_sample":
                self._reduce_single(folder, name, total)
            else:
                self._reduce_accumulate(folder, name)

    def _partial(self, name: str, worker: int, stem: str) -> MMapIndexedDataset | None:
        prefix = _worker_dir(self.save_path, name, worker) / f"{name}_{stem}"
        if not MMapIndexedDataset.exists(prefix):
            return None
        return MMapIndexedDataset(prefix)

    def _reduce_single(self, folder: Path, name: str, total: int) -> None:
        parts = []
        for worker in range(self.num_workers):
            part = self._partial(name, worker, "sample_to_metric")
            start, end = self.worker_range(worker)
            if part is None:
                raise RuntimeError(f"DataAnalyzer reduce: worker {worker}'s map result for metric {name!r} is "
                                   "missing; run every worker's run_map before run_reduce")
            if len(part) != end - start:
                raise RuntimeError(f"DataAnalyzer reduce: worker {worker}'s map result for metric {name!r} has "
                                   f"{len(part)} samples, its range [{start}, {end}) has {end - start}")
            parts.append(_one_per_array(part, name))
        values = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if values.size == 0:
            raise RuntimeError(f"DataAnalyzer reduce: metric {name!r} has no samples (an empty dataset)")
        value_dtype = find_fit_int_dtype(int(values.min()), int(values.max()))
        index_dtype = find_fit_int_dtype(0, total - 1)
        write_indexed(folder / f"{name}_sample_to_metric", values.reshape(-1, 1), value_dtype)
        order = np.argsort(values, kind="stable")  # by value, ties by sample index
        distinct, starts = np.unique(values[order], return_index=True)
        groups = np.split(order, starts[1:])
        write_indexed(folder / f"{name}_index_to_sample", groups, index_dtype)
        write_indexed(folder / f"{name}_index_to_metric", distinct.reshape(-1, 1), value_dtype)
        step = max(1, len(groups) // 100)
        merged = [np.concatenate(groups[i:i + step]) for i in range(0, len(groups), step)]
        write_indexed(folder / f"{name}_index_to_sample_percentile_merged", merged, index_dtype)
        logger.info("metric %s: %d samples, %d distinct values in [%d, %d]", name, total, len(distinct),
                    int(distinct[0]), int(distinct[-1]))

    def _reduce_accumulate(self, folder: Path, name: str) -> None:
        total = None
        for worker in range(self.num_workers):
            part = self._partial(name, worker, "metric_value")
            if part is None:
                start, end = self.worker_range(worker)
                if end > start:
                    raise RuntimeError(f"DataAnalyzer reduce: worker {worker}'s map result for metric {name!r} "
                                       "is missing; run every worker's run_map before run_reduce")
                continue
            value = np.asarray(part[0], dtype=np.int64)
            if total is not None and total.shape != value.shape:
                raise RuntimeError(f"DataAnalyzer reduce: metric {name!r}: worker {worker}'s sum has shape "
                                   f"{value.shape}, the others {total.shape}")
            total = value.copy() if total is None else total + value
        if total is None:
            raise RuntimeError(f"DataAnalyzer reduce: metric {name!r} has no samples (an empty dataset)")
        write_indexed(folder / f"{name}_metric_value", [total],
                      find_fit_int_dtype(int(total.min()), int(total.max())))

    def run_map_reduce(self) -> None:
        """`run_map` then, on worker 0, `run_reduce`. With several workers in several processes, call
        `run_map` on each, wait for all (a barrier), then `run_reduce` on one."""
        if self.num_workers != 1:
            raise RuntimeError(f"run_map_reduce runs one worker's map then the reduce; with num_workers="
                               f"{self.num_workers}, call run_map on every worker, wait for all, then run_reduce")
        self.run_map()
        self.run_reduce()


def _one_per_array(data: MMapIndexedDataset, name: str) -> np.ndarray:
    if np.any(data.sizes != 1):
        raise RuntimeError(f"metric {name!r}: a sample_to_metric file holds one value per array; found sizes "
                           f"{sorted(set(data.sizes.tolist()))}")
    return data.flat().astype(np.int64)


def load_metric_index(save_path: str | os.PathLike, metric: str) -> dict[str, Any]:
    """The reduce's files of ``metric`` as arrays: ``sample_to_metric`` (per sample), ``index_to_metric``
    (distinct values, ascending) and ``index_to_sample`` (a list of index arrays)."""
    folder = Path(save_path) / metric
    sample_to_metric = MMapIndexedDataset(folder / f"{metric}_sample_to_metric")
    index_to_metric = MMapIndexedDataset(folder / f"{metric}_index_to_metric")
    index_to_sample = MMapIndexedDataset(folder / f"{metric}_index_to_sample")
    return {"sample_to_metric": _one_per_array(sample_to_metric, metric),
            "index_to_metric": _one_per_array(index_to_metric, metric),
            "index_to_sample": [np.array(row) for row in index_to_sample]}
