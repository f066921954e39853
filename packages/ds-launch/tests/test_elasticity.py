"""`compute_elastic_config` against DeepSpeed's published figures and an independent brute-force reference.

The reference below computes the highly composite numbers with a divisor-count sieve, and the valid
device counts by trying every count ``g`` in ``[min_gpus, max_gpus]`` (valid when ``m × g`` divides the
batch for some micro-batch size ``m``), rather than the divisor enumeration the implementation uses."""

from __future__ import annotations

import math

import pytest

import ds_launch
from ds_launch import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
)

VERSION = "0.19.8"


def _highly_composite(limit: int) -> list[int]:
    divisors = [0] * (limit + 1)
    for i in range(1, limit + 1):
        for j in range(i, limit + 1, i):
            divisors[j] += 1
    record, out = 0, []
    for n in range(1, limit + 1):
        if divisors[n] > record:
            record = divisors[n]
            out.append(n)
    return out


HCN = _highly_composite(30000)


def _counts(batch, micro, low, high):
    return [g for g in range(max(low, 1), high + 1) if any(batch % (m * g) == 0 for m in micro)]


def reference_v01(micro, max_batch, low, high, prefer_larger=True):
    candidates = set()
    for base in set(micro) | {math.lcm(*micro)}:
        if base > max_batch:  # DeepSpeed PR 8237: a base above the maximum gives no candidate
            continue
        fitting = [base * h for h in HCN if base * h <= max_batch]
        candidates.add(fitting[-1] if fitting else base)
    scored = [(len(_counts(b, micro, low, high)), b) for b in candidates]
    most = max(n for n, _ in scored)
    tied = [b for n, b in scored if n == most]
    batch = max(tied) if prefer_larger else min(tied)
    return batch, _counts(batch, micro, low, high)


def reference_v02(micro, max_batch, low, high, world, per_node, mp, prefer_larger=True):
    dp_node = per_node // mp
    b, nodes = reference_v01(micro, max_batch // dp_node, low // per_node, high // per_node, prefer_larger)
    batch, valid = b * dp_node, [n * dp_node for n in nodes]
    if world not in valid:
        fits = [max_batch // (m * world) * m * world for m in micro]
        batch, valid = (max(fits) if prefer_larger else min(fits)), [world]
    return batch, valid


def config(**keys):
    return {"elasticity": {"enabled": True, **keys}}


# DeepSpeed's tests/unit/elasticity/test_elastic.py configuration and its published results
DEEPSPEED_TEST = dict(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17], min_gpus=32, max_gpus=1500,
                      min_time=20, version=0.1)


def test_public_names_are_pinned():
    assert sorted(ds_launch.__all__) == sorted([
        "ElasticityConfigError", "ElasticityError", "ElasticityIncompatibleWorldSize", "LaunchError",
        "__version__", "compute_elastic_config", "main", "parse_deepspeed_args", "parse_hostfile", "select_resources"])
    assert issubclass(ElasticityConfigError, ElasticityError) and issubclass(ElasticityError, ValueError)
    assert issubclass(ElasticityIncompatibleWorldSize, ElasticityError)


def test_highly_composite_reference_is_the_known_sequence():
    assert HCN[:14] == [1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720]


def test_deepspeeds_published_figures():
    batch, valid = compute_elastic_config(config(**DEEPSPEED_TEST), VERSION)
    assert (batch, len(valid)) == (9792, 23)
    assert (batch, valid) == reference_v01([8, 12, 16, 17], 10000, 32, 1500)
    assert compute_elastic_config(config(**DEEPSPEED_TEST), VERSION, world_size=64) == (batch, valid, 17)
    with pytest.raises(ElasticityIncompatibleWorldSize, match=r"world size 128 .*\[32, 34, 36"):
        compute_elastic_config(config(**DEEPSPEED_TEST), VERSION, world_size=128)


def test_the_batch_stays_within_the_maximum_when_the_lcm_exceeds_it():
    """DeepSpeed PR 8237 (in DeepSpeed since 0.19.6): the micro-batch sizes' LCM above max_train_batch_size is
    no candidate. [1, 2, 3, 7] with a maximum of 32 used to give 42; DeepSpeed's test_proper_mbsz now asks
    world size 4 (micro-batch 3) and that 7 is refused, and its test_batch_size_within_max [8, 10, 12] <= 100."""
    keys = {**DEEPSPEED_TEST, "max_train_batch_size": 32, "micro_batch_sizes": [1, 2, 3, 7], "min_gpus": 1}
    batch, valid, micro = compute_elastic_config(config(**keys), VERSION, world_size=4)
    assert batch <= 32 and 4 in valid and micro == 3 and 7 not in valid
    with pytest.raises(ElasticityIncompatibleWorldSize):
        compute_elastic_config(config(**keys), VERSION, world_size=7)
    for cap, sizes in ((100, [8, 10, 12]), (16, [8, 12])):
        keys = {**DEEPSPEED_TEST, "max_train_batch_size": cap, "micro_batch_sizes": sizes, "min_gpus": 1}
        batch, _ = compute_elastic_config(config(**keys), VERSION)
        assert batch <= cap, (sizes, cap, batch)
        assert (batch, _) == reference_v01(sizes, cap, 1, DEEPSPEED_TEST["max_gpus"])


V01_CASES = [
    # the config reference's example values (its table's defaults)
    dict(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_gpus=1, max_gpus=10000),
    dict(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_gpus=1, max_gpus=10000, prefer_larger_batch=False),
    dict(max_train_batch_size=512, micro_batch_sizes=[1, 2, 4], min_gpus=2, max_gpus=64),
    dict(max_train_batch_size=1000, micro_batch_sizes=[3, 5], min_gpus=1, max_gpus=100),
    dict(max_train_batch_size=100, micro_batch_sizes=[3, 5, 7], min_gpus=1, max_gpus=40),
    dict(max_train_batch_size=4096, micro_batch_sizes=[16], min_gpus=8, max_gpus=256, prefer_larger_batch=False),
    dict(max_train_batch_size=4, micro_batch_sizes=[1, 2, 3, 4], min_gpus=1, max_gpus=4),
]


@pytest.mark.parametrize("keys", V01_CASES)
def test_version_01_matches_the_brute_force_reference(keys):
    expected = reference_v01(keys["micro_batch_sizes"], keys["max_train_batch_size"], keys["min_gpus"],
                             keys["max_gpus"], keys.get("prefer_larger_batch", True))
    got = compute_elastic_config(config(version=0.1, **keys), VERSION)
    assert got == expected
    batch, valid = got
    for world in valid[:5] + valid[-3:]:
        micro = compute_elastic_config(config(version=0.1, **keys), VERSION, world_size=world)[2]
        assert micro == max(m for m in keys["micro_batch_sizes"] if (batch // world) % m == 0)
        assert batch % (micro * world) == 0


def test_documented_defaults_need_only_the_two_required_keys():
    keys = dict(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version="0.1")
    assert compute_elastic_config(config(**keys), VERSION) == reference_v01([2, 4, 6], 2000, 1, 10000)


V02_CASES = [  # (keys, data-parallel world size)
    (dict(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17], min_gpus=32, max_gpus=1500,
          num_gpus_per_node=8, model_parallel_size=4), 16),
    (dict(max_train_batch_size=1024, micro_batch_sizes=[2, 4], min_gpus=8, max_gpus=256, num_gpus_per_node=8), 32),
    (dict(max_train_batch_size=1024, micro_batch_sizes=[2, 4], min_gpus=8, max_gpus=256, num_gpus_per_node=8), 12),
    (dict(max_train_batch_size=600, micro_batch_sizes=[3, 4], min_gpus=2, max_gpus=64, num_gpus_per_node=2,
          prefer_larger_batch=False), 6),
    (dict(max_train_batch_size=96, micro_batch_sizes=[2, 4, 6], min_gpus=1, max_gpus=8), 4),  # the 2-rank engine's
]


@pytest.mark.parametrize("keys, world", V02_CASES)
def test_version_02_matches_the_reference_in_nodes(keys, world):
    per_node, mp = keys.get("num_gpus_per_node", 1), keys.get("model_parallel_size", 1)
    batch, valid = reference_v02(keys["micro_batch_sizes"], keys["max_train_batch_size"], keys["min_gpus"],
                                 keys["max_gpus"], world, per_node, mp, keys.get("prefer_larger_batch", True))
    micro = max(m for m in keys["micro_batch_sizes"] if (batch // world) % m == 0)
    assert compute_elastic_config(config(version=0.2, **keys), VERSION, world_size=world) == (batch, valid, micro)


def test_version_02_takes_the_world_size_from_the_environment(monkeypatch):
    keys = V02_CASES[0][0]  # DeepSpeed's test_model_parallel_v2_valid: WORLD_SIZE=16, 4-way model parallel
    monkeypatch.setenv("WORLD_SIZE", "16")
    batch, valid = compute_elastic_config(config(version=0.2, **keys), VERSION)
    assert (batch, valid) == reference_v02([8, 12, 16, 17], 10000, 32, 1500, 4, 8, 4)
    assert compute_elastic_config(config(version=0.2, **keys), VERSION, return_microbatch=True)[:2] == (batch, valid)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ElasticityConfigError, match="WORLD_SIZE"):
        compute_elastic_config(config(version=0.2, **keys), VERSION)


@pytest.mark.parametrize("key, value, message", [
    ("micro_batch_sizes", [1, 4, -1, 2, -10], "micro_batch_sizes must be a non-empty list of positive"),
    ("micro_batch_sizes", 5, "micro_batch_sizes"),
    ("micro_batch_sizes", ["a", None, 0.5], "micro_batch_sizes"),
    ("micro_batch_sizes", [2, 0.5, 4], "micro_batch_sizes"),
    ("micro_batch_sizes", [20000], "must all be <= max_train_batch_size 10000"),
    ("min_gpus", -1, "min_gpus must be an integer >= 1, got -1"),
    ("max_gpus", 16, "min_gpus 32 must be <= max_gpus 16"),
    ("min_time", -3, "min_time"),
    ("version", "0.3", "version must be 0.1 or 0.2, got '0.3'"),
    ("prefer_larger_batch", "yes", "prefer_larger_batch must be true or false"),
    ("prefer_large_batch", False, "did you mean 'prefer_larger_batch'"),
])
def test_bad_values_are_named(key, value, message):
    with pytest.raises(ElasticityConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        compute_elastic_config(config(**{**DEEPSPEED_TEST, key: value}), VERSION)


def test_deepspeeds_error_cases():
    with pytest.raises(ElasticityError, match=r"0\.3\.8"):  # an old target version
        compute_elastic_config(config(**DEEPSPEED_TEST), "0.2")
    with pytest.raises(ElasticityConfigError, match=r"enabled is false"):
        compute_elastic_config({"elasticity": {**DEEPSPEED_TEST, "enabled": False}}, VERSION)
    with pytest.raises(ElasticityConfigError, match="missing"):
        compute_elastic_config({"train_batch_size": 8}, VERSION)
    for key in ("max_train_batch_size", "micro_batch_sizes"):
        keys = {k: v for k, v in DEEPSPEED_TEST.items() if k != key}
        with pytest.raises(ElasticityConfigError, match=f"{key} is required"):
            compute_elastic_config(config(**keys), VERSION)
    with pytest.raises(ElasticityConfigError, match=r"model_parallel_size 4 needs version 0\.2"):
        compute_elastic_config(config(**{**DEEPSPEED_TEST, "model_parallel_size": 4, "num_gpus_per_node": 8}), VERSION)
    with pytest.raises(ElasticityConfigError, match="num_gpus_per_node 8 must be divisible by model_parallel_size 16"):
        compute_elastic_config(config(**{**DEEPSPEED_TEST, "version": 0.2, "model_parallel_size": 16,
                                         "num_gpus_per_node": 8}), VERSION, world_size=16)
    with pytest.raises(ElasticityConfigError, match="no batch size <= max_train_batch_size 64"):
        compute_elastic_config(config(max_train_batch_size=64, micro_batch_sizes=[8], min_gpus=100, max_gpus=200,
                                      version=0.1), VERSION)


def test_a_world_size_too_large_for_the_maximum_is_refused_in_version_02():
    keys = dict(max_train_batch_size=64, micro_batch_sizes=[8], min_gpus=1, max_gpus=8, version=0.2)
    with pytest.raises(ElasticityIncompatibleWorldSize, match="world size 16 is not valid"):
        compute_elastic_config(config(**keys), VERSION, world_size=16)
