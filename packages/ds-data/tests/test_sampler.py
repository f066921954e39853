"""DataSampler against references computed here: every index's metric checked against the difficulty of
its step (closed forms of the schedule), percentile sets by a sort by hand, ranks against one rank holding
the whole micro-batch, resumption against an uninterrupted run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ds_data import DataSampler
from ds_data._indexed import write_indexed

N = 300


@pytest.fixture(scope="module")
def metric():
    """A metric of N samples in [0, 20) with ties, and its index files (written as the analyzer would)."""
    return np.random.default_rng(7).integers(0, 20, size=N)


@pytest.fixture(scope="module")
def index(metric, tmp_path_factory):
    root = tmp_path_factory.mktemp("index")
    distinct = np.unique(metric)
    write_indexed(root / "m_index_to_sample", [np.flatnonzero(metric == v) for v in distinct], np.uint16)
    write_indexed(root / "m_index_to_metric", distinct.reshape(-1, 1), np.uint8)
    return {"index_to_sample_path": str(root / "m_index_to_sample"),
            "index_to_metric_path": str(root / "m_index_to_metric")}


def linear(low, high, total, step):
    return {"min_difficulty": low, "max_difficulty": high, "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": total, "difficulty_step": step}}


def linear_closed_form(t, low, high, total, step):
    d = math.floor(t / total * (high - low) + low)
    d -= d % step
    return min(max(d, math.ceil(low / step) * step), high)


def sampler(index, rank=0, dp=1, mbs=4, gas=2, epochs=1, seed=5, kind="value", schedule=None, **kw):
    config = {**index, "difficulty_type": kind, **(schedule or linear(4, 19, 30, 1))}
    return DataSampler(N, epochs, mbs, rank, dp, gas, curriculum_metrics={"m": config}, seed=seed, **kw)


def test_value_difficulty_is_never_exceeded(index, metric):
    s = sampler(index, mbs=3, gas=2, epochs=2)
    batches = list(s)
    assert len(batches) == 2 * N // 3 and all(len(b) == 3 for b in batches)
    reached = set()
    for m, batch in enumerate(batches):
        step = m // 2 + 1
        difficulty = linear_closed_form(step, 4, 19, 30, 1)
        assert all(metric[i] <= difficulty for i in batch), (step, difficulty, batch)
        reached.update(metric[i] for i in batch)
    assert max(reached) == 19  # the schedule reached the top and the hard samples came in
    assert s.current_difficulties == {"m": 19}


def test_percentile_draws_exactly_the_lowest_share(index, metric):
    by_hand = sorted(range(N), key=lambda i: (metric[i], i))
    for d in (10, 35, 100):
        schedule = {"min_difficulty": d, "max_difficulty": 100, "schedule_type": "fixed_discrete",
                    "schedule_config": {"difficulty": [d, d], "max_step": [1]}}
        s = sampler(index, mbs=5, gas=1, epochs=3, kind="percentile", schedule=schedule)
        drawn = {i for batch in s for i in batch}
        allowed = set(by_hand[:(N // 100) * d]) if d < 100 else set(range(N))
        assert drawn == allowed  # never outside, and the cluster is read through (900 draws >= 3 passes)


def test_percentile_schedule_grows_the_allowed_set(index, metric):
    by_hand = sorted(range(N), key=lambda i: (metric[i], i))
    s = sampler(index, mbs=2, gas=3, epochs=2, kind="percentile", schedule=linear(10, 100, 40, 10))
    for m, batch in enumerate(s):
        d = linear_closed_form(m // 3 + 1, 10, 100, 40, 10)
        allowed = set(by_hand[:(N // 100) * d]) if d < 100 else set(range(N))
        assert set(batch) <= allowed


@pytest.mark.parametrize("dp,gas", [(2, 1), (3, 2)])
def test_ranks_split_each_micro_batch(index, dp, gas):
    whole = list(sampler(index, mbs=2 * dp, gas=gas, schedule=linear(12, 19, 10, 1)))
    per_rank = [list(sampler(index, rank=r, dp=dp, mbs=2, gas=gas, schedule=linear(12, 19, 10, 1)))
                for r in range(dp)]
    assert all(len(shares) == len(whole) for shares in per_rank)
    for m, batch in enumerate(whole):
        shares = [per_rank[r][m] for r in range(dp)]
        assert [i for share in shares for i in share] == batch
        assert len(set(batch)) == len(batch)  # the allowed set (> 150 samples) is larger than a global batch
        assert all(not set(a) & set(b) for a in shares for b in shares if a is not b)


def test_takes_the_config_model(index):
    from ds_data.config import CurriculumMetricConfig

    model = CurriculumMetricConfig(**index, difficulty_type="value", clustering_type="schedule_based",
                                   **linear(4, 19, 30, 1))
    from_model = DataSampler(N, 1, 4, 0, 1, 2, curriculum_metrics={"m": model}, seed=5)
    assert list(from_model) == list(sampler(index))


def test_deterministic_per_seed(index):
    first, again, other = (list(sampler(index, seed=s)) for s in (5, 5, 6))
    assert first == again
    assert first != other
    assert list(sampler(index, rank=1, dp=2, seed=5)) == list(sampler(index, rank=1, dp=2, seed=5))


@pytest.mark.parametrize("stop", [0, 1, 5, 6, 17, 40])  # before, in and between global batches, across changes
def test_resume_yields_the_same_rest_bit_for_bit(index, stop):
    kw = {"rank": 1, "dp": 2, "mbs": 3, "gas": 3, "epochs": 2, "schedule": linear(6, 19, 12, 1)}
    whole = list(sampler(index, **kw))
    first = sampler(index, **kw)
    it = iter(first)
    head = [next(it) for _ in range(stop)]
    state = json.loads(json.dumps(first.state_dict()))  # a checkpoint's metadata is JSON
    resumed = sampler(index, **kw)
    resumed.load_state_dict(state)
    assert head + list(resumed) == whole
    assert head + list(it) == whole


def test_no_curriculum_and_last_micro_batch(index):
    s = DataSampler(10, 1, 2, 1, 2, drop_last=False)  # rank 1 of 2, micro-batch 4: 4 + 4 + 2 samples
    batches = list(s)
    assert [len(b) for b in batches] == [2, 2, 1]
    assert len(DataSampler(10, 1, 2, 1, 2, drop_last=True)) == 10
    assert [len(b) for b in DataSampler(10, 1, 2, 1, 2, drop_last=True)] == [2, 2]
    ranks = [list(DataSampler(10, 3, 2, r, 2, seed=9)) for r in range(2)]
    drawn = [i for m in range(len(ranks[0])) for r in range(2) for i in ranks[r][m]]
    assert sorted(drawn[:10]) == list(range(10))  # one cluster of all samples, read through before reshuffling


def test_single_cluster_metric_does_not_restrict(index):
    s = DataSampler(N, 1, 10, 0, 1, curriculum_metrics={"seqlen": {**linear(8, 64, 5, 8),
                                                                   "clustering_type": "single_cluster"}})
    drawn = {i for batch in s for i in batch}
    assert drawn == set(range(N))
    assert s.current_difficulties == {"seqlen": 64}


def test_empty_start_and_decreasing_difficulty(index):
    # percentile with max_difficulty 1000 over 300 samples: (300 // 1000) * d = 0 samples below the top
    s = sampler(index, kind="percentile", schedule=linear(5, 1000, 10, 1))
    with pytest.raises(RuntimeError, match=r"no sample is within the difficulties \{'m': 104\} at step 1"):
        next(iter(s))
    below = {"min_difficulty": 0, "max_difficulty": 19, "schedule_type": "custom"}
    s = sampler(index, gas=1, schedule=below)
    s.set_custom_curriculum_learning_schedule({"m": lambda step: 10 if step == 1 else 5})
    it = iter(s)
    next(it)
    with pytest.raises(NotImplementedError, match=r"decreases \(metric 'm': 5 after 10 at step 2\)"):
        next(it)
    with pytest.raises(ValueError, match=r"no curriculum metric \['x'\]"):
        s.set_custom_curriculum_learning_schedule({"x": len})


def test_bad_input_is_named(index):
    with pytest.raises(ValueError, match="difficulty_type 'rank'; allowed: value, percentile"):
        sampler(index, kind="rank")
    with pytest.raises(ValueError, match="min_difficulty 30 is above max_difficulty 19"):
        sampler(index, schedule=linear(30, 19, 10, 1))
    with pytest.raises(ValueError, match="global_batch_size 10 must equal micro_batch_size 4 x data_parallel_size "
                                         "1 x gradient_accumulation_steps 2 = 8"):
        sampler(index, global_batch_size=10)
    with pytest.raises(ValueError, match=r"data_parallel_rank must be in \[0, 2\), got 2"):
        sampler(index, rank=2, dp=2)
    with pytest.raises(ValueError, match="micro_batch_size must be an integer >= 1, got 0"):
        sampler(index, mbs=0)
    with pytest.raises(ValueError, match="clustering_type 'none'"):
        DataSampler(N, 1, 1, 0, 1, curriculum_metrics={"m": {**index, **linear(1, 2, 3, 1), "clustering_type": "none"}})
    with pytest.raises(ValueError, match=r"unknown keys \['index_path'\]"):
        DataSampler(N, 1, 1, 0, 1, curriculum_metrics={"m": {"index_path": "x", **linear(1, 2, 3, 1)}})
    with pytest.raises(ValueError, match="needs index_to_sample_path"):
        DataSampler(N, 1, 1, 0, 1, curriculum_metrics={"m": linear(1, 2, 3, 1)})
    with pytest.raises(ValueError, match="needs index_to_metric_path"):
        DataSampler(N, 1, 1, 0, 1, curriculum_metrics={"m": {"index_to_sample_path": index["index_to_sample_path"],
                                                             **linear(1, 2, 3, 1)}})
    with pytest.raises(ValueError, match=r"outside the 100 samples of an epoch"):
        DataSampler(100, 1, 1, 0, 1, curriculum_metrics={"m": {**index, **linear(1, 2, 3, 1)}})
    state = sampler(index).state_dict()
    with pytest.raises(ValueError, match="seed 5 differs from this sampler's 6"):
        sampler(index, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="a DataSampler state has the keys"):
        sampler(index).load_state_dict({"batch": []})
