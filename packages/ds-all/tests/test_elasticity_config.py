"""The ``elasticity`` section: its model, and the batch triad `Config.resolve` (and so `initialize`) takes
from it. Expected triads come from DeepSpeed's published figures or are derived by hand in comments."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import ds_all
import ds_launch
from ds_all import Config
from ds_all.elasticity import (
    ElasticityConfig,
    ElasticityConfigError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
    elasticity_enabled,
)
from ds_comm.testing import spawn

# DeepSpeed's tests/unit/elasticity/test_elastic.py: batch 9792 over 23 GPU counts; at 64 GPUs micro-batch 17
DEEPSPEED_TEST = {"enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17],
                  "min_gpus": 32, "max_gpus": 1500, "min_time": 20, "version": 0.1}
# DeepSpeed's 2-rank engine test's section. Candidates (each size scaled by the largest highly composite number
# keeping it <= 4; the LCM 12 exceeds the maximum and is none, DeepSpeed's PR 8237): 4, 4, 3, 4; device counts in
# [1, 4] that m × g divides: 4 -> {1, 2, 4}, 3 -> {1, 3}. So 4; at 2 ranks 4 / 2 = 2, whose largest divisor among
# the sizes is 2: accumulation 4 / (2 × 2) = 1. (Before PR 8237: the LCM 12, micro-batch 3, accumulation 2.)
SMALL = {"enabled": True, "max_train_batch_size": 4, "micro_batch_sizes": [1, 2, 3, 4], "min_gpus": 1,
         "max_gpus": 4, "min_time": 20, "version": 0.1}


def test_the_deepspeed_path_holds_ds_launchs_objects():
    import ds_all.elasticity as module

    for name in ("compute_elastic_config", "ElasticityError", "ElasticityConfigError",
                 "ElasticityIncompatibleWorldSize"):
        assert getattr(module, name) is getattr(ds_launch, name)
    assert ds_all.elasticity is module and "elasticity" in ds_all.__all__
    assert elasticity_enabled({"elasticity": {"enabled": True}}) and not elasticity_enabled({"train_batch_size": 4})


def test_every_documented_key_loads_with_the_documented_defaults():
    section = Config.load({"train_batch_size": 4}).elasticity
    assert section.model_dump() == {
        "enabled": False, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "min_gpus": 1,
        "max_gpus": 10000, "min_time": 0, "version": 0.2, "prefer_larger_batch": True,
        "ignore_non_elastic_batch_info": False, "num_gpus_per_node": 1, "model_parallel_size": 1}
    keys = {"enabled": True, "max_train_batch_size": 1e3, "micro_batch_sizes": [2, 4], "min_gpus": 2, "max_gpus": 8,
            "min_time": 5, "version": "0.2", "prefer_larger_batch": False, "ignore_non_elastic_batch_info": True,
            "num_gpus_per_node": 2, "model_parallel_size": 2}
    loaded = Config.load({"elasticity": keys}).elasticity
    assert loaded.max_train_batch_size == 1000 and loaded.model_parallel_size == 2 and loaded.enabled


@pytest.mark.parametrize("keys, words", [
    ({"enabled": True}, "max_train_batch_size and micro_batch_sizes must be given"),
    ({"prefer_large_batch": False}, "prefer_larger_batch"),  # the reference page's misspelling: did you mean
    ({"version": 0.3}, "version must be 0.1 or 0.2, got 0.3"),
    ({"micro_batch_sizes": [2, 0]}, "micro_batch_sizes must be positive"),
    ({"min_gpus": 8, "max_gpus": 4}, "min_gpus 8 must be <= max_gpus 4"),
])
def test_bad_values_are_named(keys, words):
    with pytest.raises(ValueError, match=words):
        ElasticityConfig.from_ds_config({"elasticity": keys})


def test_resolve_takes_the_triad_from_elasticity():
    config = Config.load({"elasticity": DEEPSPEED_TEST}).resolve(dp_world_size=64)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == \
        (9792, 17, 9792 // (17 * 64))
    assert config.resolve(dp_world_size=64) == config  # a resolved config resolves to itself
    small = Config.load({"elasticity": SMALL}).resolve(dp_world_size=2)
    assert (small.train_batch_size, small.train_micro_batch_size_per_gpu, small.gradient_accumulation_steps) == \
        (4, 2, 1)


def test_a_world_size_the_config_does_not_allow_names_the_valid_ones():
    _, valid = compute_elastic_config({"elasticity": DEEPSPEED_TEST}, "0.19.8")
    with pytest.raises(ElasticityIncompatibleWorldSize, match=r"world size 128 .*\[32, 34, 36, 48"):
        Config.load({"elasticity": DEEPSPEED_TEST}).resolve(dp_world_size=128)
    assert 128 not in valid and 64 in valid


def test_batch_keys_outside_the_section_are_refused_unless_ignored(caplog):
    given = {"train_batch_size": 2, "elasticity": SMALL}
    with pytest.raises(ElasticityConfigError, match="train_batch_size 2 given while elasticity is enabled"):
        Config.load(given).resolve(dp_world_size=2)
    ignoring = {"train_batch_size": 2, "gradient_accumulation_steps": 3,
                "elasticity": {**SMALL, "ignore_non_elastic_batch_info": True}}
    with caplog.at_level(logging.WARNING):
        config = Config.load(ignoring).resolve(dp_world_size=2)
    assert (config.train_batch_size, config.gradient_accumulation_steps) == (4, 1)
    assert "train_batch_size 2, gradient_accumulation_steps 3 ignored" in caplog.text


def test_disabled_elasticity_leaves_the_triad_alone():
    config = Config.load({"train_batch_size": 8, "elasticity": {**SMALL, "enabled": False}}).resolve(dp_world_size=2)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu) == (8, 4)


def _elastic_engine(rank, world_size):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    engine, *_ = ds_all.initialize(model=model, config={
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "elasticity": SMALL})
    for _ in range(engine.gradient_accumulation_steps()):
        x = torch.full((engine.train_micro_batch_size_per_gpu(), 4), float(rank + 1))
        engine.backward(engine(x).sum())
        engine.step()
    return engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(), \
        engine.global_steps


def test_initialize_on_two_ranks_uses_the_elastic_triad():
    assert spawn(_elastic_engine, world_size=2, timeout=120) == [(4, 2, 1, 1)] * 2
