"""The tuners: the order experiments are run in, and when to stop (DeepSpeed's ``tuner/``).

A tuner gets the experiments and ``evaluate(exps) -> [metric or None]`` (None: the run failed) and
runs `tune`: batches of ``sample_size`` experiments until ``n_trials`` were run, the space is spent,
or ``early_stopping`` experiments in a row did not beat the best (DeepSpeed's rule:
stop when ``i >= best_iter + early_stopping``; 0 never stops early).

- `GridSearchTuner`: in the given order. - `RandomTuner`: in random order.
- `ModelBasedTuner`: a cost model (DeepSpeed uses XGBoost; here a ridge regression on quadratic
  features of the experiments' ``features``, standard library only) fitted to the results so far ranks
  the unvisited neighbours of the best experiment (one level away in each feature); the best-ranked runs
  next. When the best has no unvisited neighbour, the model's best anywhere runs (or, with
  ``exploration`` > 0, a random one that often).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence

log = logging.getLogger("ds_autotune")

Evaluate = Callable[[list[dict]], list[float | None]]


class BaseTuner:
    """Common loop; subclasses pick `next_batch`."""

    def __init__(self, exps: Sequence[dict], evaluate: Evaluate, higher_is_better: bool = True,
                 seed: int | None = None) -> None:
        self.all_exps = list(exps)
        self.evaluate = evaluate
        self.higher_is_better = higher_is_better
        self.rng = random.Random(seed)
        self.best_exp: dict | None = None
        self.best_metric_val: float | None = None
        self.best_iter = 0
        self.history: list[tuple[dict, float | None]] = []

    def has_next(self) -> bool:
        return bool(self.all_exps)

    def next_batch(self, sample_size: int) -> list[dict]:
        raise NotImplementedError("BaseTuner.next_batch: use GridSearchTuner, RandomTuner or ModelBasedTuner")

    def update(self) -> None:
        """Learn from ``self.history`` (the model-based tuner refits)."""

    def better(self, a: float, b: float | None) -> bool:
        return b is None or (a > b if self.higher_is_better else a < b)

    def tune(self, sample_size: int = 1, n_trials: int = 1000, early_stopping: int | None = None) -> int:
        """Run experiments; returns how many were run. The best is ``best_exp``/``best_metric_val``."""
        i = 0
        while i < n_trials and self.has_next():
            batch = self.next_batch(min(sample_size, n_trials - i))
            if not batch:
                break
            values = self.evaluate(batch)
            for exp, value in zip(batch, values, strict=True):
                self.history.append((exp, value))
                if value is not None and self.better(value, self.best_metric_val):
                    self.best_exp, self.best_metric_val, self.best_iter = exp, value, i
                i += 1
            self.update()
            if early_stopping and i >= self.best_iter + 1 + early_stopping:
                log.info("tuner stopped early after %d experiments: the best (%s, experiment %d) was not beaten "
                         "in %d more", i, self.best_exp["name"] if self.best_exp else None, self.best_iter + 1,
                         early_stopping)
                break
        return i


class GridSearchTuner(BaseTuner):
    """The experiments in their given order."""

    def next_batch(self, sample_size: int) -> list[dict]:
        batch, self.all_exps = self.all_exps[:sample_size], self.all_exps[sample_size:]
        return batch


class RandomTuner(BaseTuner):
    """The experiments in random order."""

    def next_batch(self, sample_size: int) -> list[dict]:
        batch = self.rng.sample(self.all_exps, min(sample_size, len(self.all_exps)))
        self.all_exps = [e for e in self.all_exps if all(e is not b for b in batch)]
        return batch


INIT_NUM = 1  # trials before the cost model is used (DeepSpeed: 2)


class ModelBasedTuner(BaseTuner):
    """Ranks the unvisited experiments by a cost model fitted to the visited ones.

    The first experiment is the one a prior favours: the lowest ZeRO stage (least communication) at
    the largest micro-batch size (DeepSpeed's fast mode also starts each stage at its largest size);
    then the model's best prediction among the best experiment's unvisited neighbours (see the module
    docstring)."""

    def __init__(self, exps: Sequence[dict], evaluate: Evaluate, higher_is_better: bool = True,
                 seed: int | None = None, exploration: float = 0.0) -> None:
        super().__init__(exps, evaluate, higher_is_better, seed)
        self.exploration = exploration
        feats = [list(e["features"]) for e in self.all_exps]
        width = max((len(f) for f in feats), default=0)
        feats = [f + [0.0] * (width - len(f)) for f in feats]
        lows = [min(col) for col in zip(*feats, strict=True)] if feats else []
        spans = [max(col) - lo or 1.0 for col, lo in zip(zip(*feats, strict=True), lows, strict=False)] if feats else []
        self.x = [[(v - lo) / s for v, lo, s in zip(f, lows, spans, strict=True)] for f in feats]
        levels = [sorted(set(col)) for col in zip(*feats, strict=True)] if feats else []
        self.level = [[levels[d].index(v) for d, v in enumerate(f)] for f in feats]
        self.visited: set[int] = set()
        self.scores: list[float] | None = None

    def has_next(self) -> bool:
        return len(self.visited) < len(self.all_exps)

    def _initial(self) -> int:
        if not self.visited:  # lowest stage (feature 0), then no offload (1), then largest micro-batch (2)
            return min(range(len(self.x)), key=lambda i: (self.x[i][0], self.x[i][1], -self.x[i][2]))
        return max((i for i in range(len(self.x)) if i not in self.visited),
                   key=lambda i: min(_dist(self.x[i], self.x[j]) for j in self.visited))

    def _neighbours(self, left: list[int]) -> list[int]:
        best = next((i for i, e in enumerate(self.all_exps) if e is self.best_exp), None)
        if best is None:
            return []
        return [i for i in left if max(abs(a - b) for a, b in zip(self.level[i], self.level[best], strict=True)) <= 1]

    def next_batch(self, sample_size: int) -> list[dict]:
        batch = []
        for _ in range(sample_size):
            left = [i for i in range(len(self.all_exps)) if i not in self.visited]
            if not left:
                break
            if len(self.visited) < INIT_NUM or self.scores is None:
                index = self._initial()
            else:
                near = self._neighbours(left)
                if not near and self.exploration and self.rng.random() < self.exploration:
                    near = left = [self.rng.choice(left)]
                sign = 1.0 if self.higher_is_better else -1.0
                index = max(near or left, key=lambda i: sign * self.scores[i])
            self.visited.add(index)
            batch.append(self.all_exps[index])
        return batch

    def update(self) -> None:
        index = {id(e): i for i, e in enumerate(self.all_exps)}
        rows, ys = [], []
        for exp, value in self.history:
            if id(exp) not in index:
                continue
            rows.append(_quadratic(self.x[index[id(exp)]]))
            ys.append(value)
        ok = [v for v in ys if v is not None]
        if len(ok) < 1:
            return
        # a failed run (out of memory) counts as the worst seen, as DeepSpeed's tuner records 0 throughput
        worst = min(ok) if self.higher_is_better else max(ok)
        fill = worst * (0.5 if self.higher_is_better else 2.0)
        ys = [fill if v is None else v for v in ys]
        scale = max(abs(v) for v in ys) or 1.0
        weights = _ridge(rows, [v / scale for v in ys], lam=1e-2)
        self.scores = [sum(w * f for w, f in zip(weights, _quadratic(x), strict=True)) for x in self.x]


def _dist(a: list[float], b: list[float]) -> float:
    return sum((p - q) ** 2 for p, q in zip(a, b, strict=True))


def _quadratic(x: list[float]) -> list[float]:
    out = [1.0, *x, *(v * v for v in x)]
    out += [x[i] * x[j] for i in range(len(x)) for j in range(i + 1, len(x))]
    return out


def _ridge(rows: list[list[float]], ys: list[float], lam: float) -> list[float]:
    """argmin_w |Rw - y|^2 + lam |w[1:]|^2, by Gauss-Jordan elimination on the normal equations."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) + (lam if i == j and i > 0 else 0.0) for j in range(n)] for i in range(n)]
    a[0][0] += 1e-9
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-15:
            continue
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(n):
            if r != col and a[r][col]:
                f = a[r][col] / a[col][col]
                a[r] = [u - f * v for u, v in zip(a[r], a[col], strict=True)]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] if abs(a[i][i]) > 1e-15 else 0.0 for i in range(n)]


TUNERS = {"gridsearch": GridSearchTuner, "random": RandomTuner, "model_based": ModelBasedTuner}
