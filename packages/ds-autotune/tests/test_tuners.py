"""The tuners on synthetic experiment results: order, early stopping, trial limits, the metric's direction,
failed runs, and the model-based tuner finding the best of a smooth space in fewer runs than the grid."""

import itertools
import math

import pytest

from ds_autotune import GridSearchTuner, ModelBasedTuner, RandomTuner


def _space(stages=(0, 1, 2, 3), sizes=(1, 2, 4, 8, 16, 32)):
    return [{"name": f"z{s}_mbs{m}", "stage": s, "mbs": m, "features": [float(s), 0.0, math.log2(m), 0.0]}
            for s, m in itertools.product(stages, sizes)]


def _throughput(exp):  # larger micro-batches amortise overhead, higher stages communicate more
    return exp["mbs"] * 100.0 / (exp["mbs"] + 6.0) / (1.0 + 0.15 * exp["stage"])


class Recorder:
    def __init__(self, metric=_throughput, fail=()):
        self.metric, self.fail, self.ran = metric, set(fail), []

    def __call__(self, exps):
        self.ran += [e["name"] for e in exps]
        return [None if e["name"] in self.fail else self.metric(e) for e in exps]


def test_gridsearch_runs_in_order_and_finds_the_maximum():
    exps, rec = _space(), Recorder()
    tuner = GridSearchTuner(exps, rec)
    assert tuner.tune(n_trials=100) == len(exps)
    assert rec.ran == [e["name"] for e in exps]
    assert tuner.best_exp["name"] == max(exps, key=_throughput)["name"] == "z0_mbs32"


def test_random_runs_every_experiment_once_in_a_seeded_order():
    exps = _space()
    first, second = Recorder(), Recorder()
    RandomTuner(exps, first, seed=3).tune(n_trials=100)
    RandomTuner(exps, second, seed=3).tune(n_trials=100)
    assert sorted(first.ran) == sorted(e["name"] for e in exps) and first.ran == second.ran
    assert first.ran != [e["name"] for e in exps]


def test_early_stopping_counts_experiments_past_the_best():
    exps = sorted(_space(), key=_throughput, reverse=True)  # the best comes first
    rec = Recorder()
    tuner = GridSearchTuner(exps, rec)
    assert tuner.tune(early_stopping=3) == 4  # the best, then 3 that do not beat it
    assert tuner.best_exp["name"] == "z0_mbs32" and tuner.best_iter == 0
    rec = Recorder()
    assert GridSearchTuner(exps, rec).tune(early_stopping=0) == len(exps)  # 0: never stop early


def test_num_trials_limits_the_runs():
    rec = Recorder()
    assert GridSearchTuner(_space(), rec).tune(n_trials=5) == 5 and len(rec.ran) == 5


def test_latency_lower_is_better_and_failures_are_never_best():
    exps = _space(stages=(0,), sizes=(1, 2, 4))
    rec = Recorder(metric=lambda e: 10.0 / e["mbs"], fail={"z0_mbs4"})
    tuner = GridSearchTuner(exps, rec, higher_is_better=False)
    tuner.tune()
    assert tuner.best_exp["name"] == "z0_mbs2" and tuner.best_metric_val == 5.0
    assert [v for _, v in tuner.history] == [10.0, 5.0, None]


def test_model_based_finds_the_best_in_a_third_of_the_grid():
    exps = _space()
    # a surface whose optimum is inside, not at a corner: stage 1, micro-batch 8
    peak = {"stage": 1, "mbs": 8}

    def metric(e):
        return 100.0 - 8.0 * (e["stage"] - peak["stage"]) ** 2 - 5.0 * (math.log2(e["mbs"]) - 3) ** 2

    for seed in range(3):
        rec = Recorder(metric)
        tuner = ModelBasedTuner(exps, rec, seed=seed)
        n = tuner.tune(early_stopping=3)
        assert tuner.best_exp["name"] == "z1_mbs8", (seed, rec.ran)
        assert n <= len(exps) // 3, (seed, rec.ran)
        assert len(set(rec.ran)) == len(rec.ran)  # never the same experiment twice


def test_model_based_prior_starts_at_lowest_stage_largest_batch():
    rec = Recorder()
    tuner = ModelBasedTuner(_space(), rec, seed=0)
    tuner.tune(early_stopping=2)
    assert rec.ran[0] == "z0_mbs32" and tuner.best_exp["name"] == "z0_mbs32"


def test_model_based_visits_everything_without_limits():
    rec = Recorder(fail={"z2_mbs4"})
    tuner = ModelBasedTuner(_space(stages=(0, 2), sizes=(1, 4, 16)), rec, seed=1)
    assert tuner.tune(n_trials=100) == 6 and sorted(rec.ran) == sorted(e["name"] for e in tuner.all_exps)


@pytest.mark.parametrize("cls", [GridSearchTuner, RandomTuner, ModelBasedTuner])
def test_every_tuner_handles_an_empty_space(cls):
    tuner = cls([], Recorder())
    assert tuner.tune() == 0 and tuner.best_exp is None
