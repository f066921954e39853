"""`DataSampler`: each step's batch drawn from the samples the curriculum allows (DeepSpeed's
``DeepSpeedDataSampler``).

What a metric allows at difficulty ``d`` is a prefix of its ``index_to_sample`` rows read in order (values
ascending, sample indices ascending within a value), so the allowed set only grows with ``d``:

* ``difficulty_type: "value"``: the rows whose ``index_to_metric`` value is ``<= d``;
* ``difficulty_type: "percentile"``: the first ``(N // max_difficulty) * d`` samples of the rows, all ``N``
  at ``d >= max_difficulty`` (DeepSpeed's count: with ``max_difficulty`` 100, ``d`` percent of the samples
  with the lowest values, ties by index);
* ``clustering_type: "single_cluster"``: every sample (the metric's difficulty is still scheduled).

Several metrics: a sample is allowed when every metric allows it. As DeepSpeed, the samples are kept in
clusters: at each step whose difficulties changed, the newly allowed samples (allowed now, in no cluster
yet) form a new cluster, shuffled. A global batch (``micro_batch_size * data_parallel_size *
gradient_accumulation_steps`` samples) picks a cluster per slot with probability proportional to the
cluster's size, takes each cluster's samples in its shuffled order (a cluster used up is reshuffled and
read again) and shuffles the batch. Micro-batch ``j`` of a global batch is its ``j``-th run of
``micro_batch_size * data_parallel_size`` samples; rank ``r`` gets ``[round(r * n / dp), round((r + 1) * n /
dp))`` of it.

Every rank draws the same global batch from the same ``seed`` (no communication): the ranks' shares are
disjoint slices of it. The batch draw uses one generator (``[seed, 1]``); cluster ``k``'s ``r``-th order is
``default_rng([seed, 2, k, r]).permutation`` of its sorted members, so a state (`DataSampler.state_dict`,
JSON values) need not hold the clusters: `DataSampler.load_state_dict` rebuilds them from the index files.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from ._curriculum import CurriculumScheduler
from ._indexed import MMapIndexedDataset

logger = logging.getLogger(__name__)

DIFFICULTY_TYPES = ("value", "percentile")
CLUSTERING_TYPES = ("schedule_based", "single_cluster")
_SCHEDULE_KEYS = ("min_difficulty", "max_difficulty", "schedule_type", "schedule_config")
_METRIC_KEYS = frozenset((*_SCHEDULE_KEYS, "index_to_sample_path", "index_to_metric_path", "difficulty_type",
                          "clustering_type"))
_STATE_KEYS = frozenset(("consumed_samples", "curriculum_step", "current_difficulties", "batch", "clusters",
                         "rng_state", "schedulers", "seed", "total_samples", "global_batch_size"))


def _count(value: Any, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"DataSampler: {name} must be an integer >= {low}, got {value!r}")
    return int(value)


class _Metric:
    """One curriculum metric: its scheduler and the prefix of its sample order each difficulty allows."""

    def __init__(self, name: str, config: Mapping[str, Any], total: int) -> None:
        unknown = sorted(set(config) - _METRIC_KEYS)
        if unknown:
            raise ValueError(f"DataSampler: metric {name!r} has unknown keys {unknown}; allowed: "
                             f"{sorted(_METRIC_KEYS)}")
        self.name = name
        self.difficulty_type = config.get("difficulty_type", "value")
        if self.difficulty_type not in DIFFICULTY_TYPES:
            raise ValueError(f"DataSampler: metric {name!r} has difficulty_type {self.difficulty_type!r}; allowed: "
                             f"{', '.join(DIFFICULTY_TYPES)}")
        self.clustering_type = config.get("clustering_type", "schedule_based")
        if self.clustering_type not in CLUSTERING_TYPES:
            raise ValueError(f"DataSampler: metric {name!r} has clustering_type {self.clustering_type!r}; allowed: "
                             f"{', '.join(CLUSTERING_TYPES)}")
        try:
            self.scheduler = CurriculumScheduler({key: config[key] for key in _SCHEDULE_KEYS if key in config})
        except ValueError as error:
            raise ValueError(f"DataSampler: metric {name!r}: {error}") from error
        self.max_difficulty = self.scheduler.state["max_difficulty"]
        self.order = np.arange(total, dtype=np.int64)  # single_cluster: every sample, at any difficulty
        self.row_ends = np.zeros(0, dtype=np.int64)
        self.values = np.zeros(0, dtype=np.int64)
        if self.clustering_type == "schedule_based":
            self._load(config, total)

    def _load(self, config: Mapping[str, Any], total: int) -> None:
        name = self.name
        path = config.get("index_to_sample_path")
        if not path:
            raise ValueError(f"DataSampler: metric {name!r} (clustering_type schedule_based) needs "
                             "index_to_sample_path (the DataAnalyzer's <metric>_index_to_sample prefix)")
        rows = MMapIndexedDataset(os.fspath(path))
        self.order = rows.flat().astype(np.int64)
        self.row_ends = np.cumsum(rows.sizes.astype(np.int64))
        if self.order.size and (self.order.min() < 0 or self.order.max() >= total):
            raise ValueError(f"DataSampler: metric {name!r}: {path} holds sample indices in [{self.order.min()}, "
                             f"{self.order.max()}], outside the {total} samples of an epoch (total_samples)")
        if self.difficulty_type == "value":
            path = config.get("index_to_metric_path")
            if not path:
                raise ValueError(f"DataSampler: metric {name!r} (difficulty_type value) needs index_to_metric_path "
                                 "(the DataAnalyzer's <metric>_index_to_metric prefix)")
            values = MMapIndexedDataset(os.fspath(path))
            if np.any(values.sizes != 1) or len(values) != len(rows):
                raise ValueError(f"DataSampler: metric {name!r}: {path} must hold one value per row of "
                                 f"index_to_sample ({len(rows)} rows), got {len(values)} arrays of sizes "
                                 f"{sorted(set(values.sizes.tolist()))}")
            self.values = values.flat().astype(np.int64)
            if np.any(np.diff(self.values) <= 0):
                raise ValueError(f"DataSampler: metric {name!r}: the values of {path} must be strictly ascending")
        elif self.max_difficulty < 1:
            raise ValueError(f"DataSampler: metric {name!r} (difficulty_type percentile) needs max_difficulty >= 1 "
                             f"(the 100% mark), got {self.max_difficulty}")

    def allowed(self, difficulty: int) -> np.ndarray:
        """The sample indices this metric allows at ``difficulty``."""
        if self.clustering_type == "single_cluster":
            return self.order
        if self.difficulty_type == "value":
            rows = int(np.searchsorted(self.values, difficulty, side="right"))
            return self.order[:int(self.row_ends[rows - 1]) if rows else 0]
        if difficulty >= self.max_difficulty:
            return self.order
        return self.order[:(self.order.size // self.max_difficulty) * max(difficulty, 0)]


class DataSampler:
    """Micro-batches of sample indices for this data-parallel rank, drawn by curriculum difficulty.

    ``total_samples``: the samples of one epoch (dataset indices ``0 .. total_samples - 1``); the sampler
    yields ``total_samples * num_epochs`` samples in all (global batches are drawn with replacement across
    clusters, so an "epoch" is a count, not a pass). ``curriculum_metrics``: ``{metric: config}`` with the
    keys of a ``data_sampling.curriculum_learning.curriculum_metrics`` entry (``index_to_sample_path``,
    ``index_to_metric_path``, ``difficulty_type``, ``clustering_type``, ``min_difficulty``,
    ``max_difficulty``, ``schedule_type``, ``schedule_config``); None or empty: no curriculum, every sample
    allowed; a config model with those fields is taken too. ``global_rank`` is kept for DeepSpeed's signature (every rank draws the batch itself)."""

    def __init__(self, total_samples: int, num_epochs: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, gradient_accumulation_steps: int = 1, global_rank: int = 0,
                 drop_last: bool = True, curriculum_metrics: Mapping[str, Mapping[str, Any]] | None = None,
                 seed: int = 1234, global_batch_size: int | None = None) -> None:
        self.one_epoch_total_samples = _count(total_samples, "total_samples")
        self.num_epochs = _count(num_epochs, "num_epochs")
        self.total_samples = self.one_epoch_total_samples * self.num_epochs
        self.micro_batch_size = _count(micro_batch_size, "micro_batch_size")
        self.data_parallel_size = _count(data_parallel_size, "data_parallel_size")
        self.data_parallel_rank = _count(data_parallel_rank, "data_parallel_rank", 0)
        if self.data_parallel_rank >= self.data_parallel_size:
            raise ValueError(f"DataSampler: data_parallel_rank must be in [0, {self.data_parallel_size}), got "
                             f"{data_parallel_rank}")
        self.gradient_accumulation_steps = _count(gradient_accumulation_steps, "gradient_accumulation_steps")
        self.global_rank = _count(global_rank, "global_rank", 0)
        self.micro_batch_times_data_parallel_size = self.micro_batch_size * self.data_parallel_size
        self.global_batch_size = self.micro_batch_times_data_parallel_size * self.gradient_accumulation_steps
        if global_batch_size is not None and global_batch_size != self.global_batch_size:
            raise ValueError(f"DataSampler: global_batch_size {global_batch_size!r} must equal micro_batch_size "
                             f"{micro_batch_size} x data_parallel_size {data_parallel_size} x "
                             f"gradient_accumulation_steps {gradient_accumulation_steps} = {self.global_batch_size}")
        self.drop_last = bool(drop_last)
        self.seed = _count(seed, "seed", 0)
        metrics = dict(curriculum_metrics or {})
        for name, config in metrics.items():
            if hasattr(config, "model_dump"):  # a config model (ds_data.config's CurriculumMetricConfig)
                metrics[name] = config = {k: v for k, v in config.model_dump().items() if v is not None}
            if not isinstance(name, str) or not isinstance(config, Mapping):
                raise ValueError(f"DataSampler: curriculum_metrics maps a metric name to its config dict, got "
                                 f"{name!r}: {type(config).__name__}")
        self._metrics = {name: _Metric(name, config, self.one_epoch_total_samples) for name, config in metrics.items()}
        self._rng = np.random.default_rng([self.seed, 1])
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.current_difficulties: dict[str, int] = {}
        self.batch: list[int] = []
        self._clusters: list[dict[str, Any]] = []   # {"difficulties", "position", "reshuffles"}, JSON values
        self._members: list[np.ndarray] = []        # each cluster's samples, sorted
        self._orders: list[np.ndarray] = []         # each cluster's current shuffled order
        self._covered = np.zeros(self.one_epoch_total_samples, dtype=bool)

    def __len__(self) -> int:
        return self.total_samples

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Mapping[str, Callable[[int], int]]) -> None:
        """``{metric: fn}``: the difficulty functions of metrics whose ``schedule_type`` is ``custom``."""
        unknown = sorted(set(schedule_func_dict) - set(self._metrics))
        if unknown:
            raise ValueError(f"DataSampler: no curriculum metric {unknown}; the metrics are {sorted(self._metrics)}")
        for name, fn in schedule_func_dict.items():
            self._metrics[name].scheduler.set_custom_get_difficulty(fn)

    def get_start_end_idx(self, batch_len: int | None = None) -> tuple[int, int]:
        """This rank's ``[start, end)`` in a micro-batch of ``batch_len`` (micro_batch_size x dp by default)."""
        n = batch_len or self.micro_batch_times_data_parallel_size
        return (round(self.data_parallel_rank * n / self.data_parallel_size),
                round((self.data_parallel_rank + 1) * n / self.data_parallel_size))

    # ---------------------------------------------------------------------------- clusters
    def _allowed_mask(self, difficulties: Mapping[str, int]) -> np.ndarray:
        mask = np.ones(self.one_epoch_total_samples, dtype=bool)
        for name, metric in self._metrics.items():
            if metric.clustering_type == "single_cluster":
                continue
            allowed = np.zeros_like(mask)
            allowed[metric.allowed(difficulties[name])] = True
            mask &= allowed
        return mask

    def _shuffled(self, k: int, reshuffles: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 2, k, reshuffles]).permutation(self._members[k])

    def _add_cluster(self, difficulties: Mapping[str, int], position: int = 0, reshuffles: int = 0) -> bool:
        members = np.flatnonzero(self._allowed_mask(difficulties) & ~self._covered)
        if members.size == 0:
            return False
        self._covered[members] = True
        self._members.append(members)
        self._clusters.append({"difficulties": dict(difficulties), "position": position, "reshuffles": reshuffles})
        self._orders.append(self._shuffled(len(self._members) - 1, reshuffles))
        logger.info("data sampler: a new cluster of %d samples at difficulties %s", members.size, dict(difficulties))
        return True

    def _take(self, k: int, count: int) -> list[np.ndarray]:
        out, cluster = [], self._clusters[k]
        while count > 0:
            if cluster["position"] >= len(self._orders[k]):
                cluster["reshuffles"] += 1
                cluster["position"] = 0
                self._orders[k] = self._shuffled(k, cluster["reshuffles"])
            start = cluster["position"]
            stop = min(start + count, len(self._orders[k]))
            out.append(self._orders[k][start:stop])
            cluster["position"] = stop
            count -= stop - start
        return out

    def _next_global_batch(self) -> None:
        self.curriculum_step += 1
        changed = not self._clusters
        for name, metric in self._metrics.items():
            difficulty = metric.scheduler.update_difficulty(self.curriculum_step)
            previous = self.current_difficulties.get(name)
            if previous is not None and difficulty < previous:
                raise NotImplementedError(f"DataSampler: a curriculum difficulty that decreases (metric {name!r}: "
                                          f"{difficulty} after {previous} at step {self.curriculum_step}); the "
                                          "allowed samples only grow")
            changed |= previous != difficulty
            self.current_difficulties[name] = int(difficulty)
        if changed:
            self._add_cluster(self.current_difficulties)
        if not self._clusters:
            raise RuntimeError(f"DataSampler: no sample is within the difficulties {self.current_difficulties} at "
                               f"step {self.curriculum_step}; lower min_difficulty or check the index files")
        sizes = np.array([len(m) for m in self._members], dtype=np.float64)
        picks = self._rng.choice(len(sizes), self.global_batch_size, replace=True, p=sizes / sizes.sum())
        counts = np.bincount(picks, minlength=len(sizes))
        parts = [part for k, count in enumerate(counts.tolist()) for part in self._take(k, count)]
        batch = np.concatenate(parts)
        self._rng.shuffle(batch)
        self.batch = batch.tolist()

    # ---------------------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[list[int]]:
        """This rank's share of each micro-batch until ``total_samples * num_epochs`` samples are consumed
        (the last micro-batch, when shorter, only if not ``drop_last``)."""
        n_full = self.micro_batch_times_data_parallel_size
        while self.consumed_samples < self.total_samples:
            n = min(n_full, self.total_samples - self.consumed_samples)
            if n < n_full and self.drop_last:
                return
            if not self.batch:
                self._next_global_batch()
            current, self.batch = self.batch[:n], self.batch[n:]
            self.consumed_samples += n
            start, end = self.get_start_end_idx(n)
            yield current[start:end]

    # ---------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Where the sampler is (JSON values): a sampler built alike and given it yields the same rest."""
        return {"consumed_samples": self.consumed_samples, "curriculum_step": self.curriculum_step,
                "current_difficulties": dict(self.current_difficulties), "batch": list(self.batch),
                "clusters": [{**c, "difficulties": dict(c["difficulties"])} for c in self._clusters],
                "rng_state": self._rng.bit_generator.state,
                "schedulers": {name: m.scheduler.state_dict() for name, m in self._metrics.items()},
                "seed": self.seed, "total_samples": self.total_samples, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict`'s result; the clusters are rebuilt from the index files."""
        if not isinstance(state, Mapping) or set(state) != _STATE_KEYS:
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"a DataSampler state has the keys {sorted(_STATE_KEYS)}, got {got}")
        for key in ("seed", "total_samples", "global_batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"DataSampler state: {key} {state[key]!r} differs from this sampler's "
                                 f"{getattr(self, key)!r}")
        if set(state["schedulers"]) != set(self._metrics) or set(state["current_difficulties"]) - set(self._metrics):
            raise ValueError(f"DataSampler state: its metrics {sorted(state['schedulers'])} are not this sampler's "
                             f"{sorted(self._metrics)}")
        batch = [int(i) for i in state["batch"]]
        if any(not 0 <= i < self.one_epoch_total_samples for i in batch):
            raise ValueError(f"DataSampler state: its batch holds indices outside [0, {self.one_epoch_total_samples})")
        for name, metric in self._metrics.items():
            metric.scheduler.load_state_dict(state["schedulers"][name])
        self._clusters, self._members, self._orders = [], [], []
        self._covered[:] = False
        for k, cluster in enumerate(state["clusters"]):
            if set(cluster["difficulties"]) != set(self._metrics):
                raise ValueError(f"DataSampler state: cluster {k} has difficulties for {sorted(cluster['difficulties'])}"
                                 f", this sampler's metrics are {sorted(self._metrics)}")
            if not self._add_cluster(cluster["difficulties"], int(cluster["position"]), int(cluster["reshuffles"])):
                raise ValueError(f"DataSampler state: its cluster {k} (difficulties {cluster['difficulties']}) has "
                                 "no sample with these index files")
            if not 0 <= self._clusters[k]["position"] <= len(self._members[k]):
                raise ValueError(f"DataSampler state: cluster {k}'s position {cluster['position']} is outside its "
                                 f"{len(self._members[k])} samples")
        self._rng = np.random.default_rng([self.seed, 1])
        self._rng.bit_generator.state = state["rng_state"]
        self.consumed_samples = int(state["consumed_samples"])
        self.curriculum_step = int(state["curriculum_step"])
        self.current_difficulties = {k: int(v) for k, v in state["current_difficulties"].items()}
        self.batch = batch
