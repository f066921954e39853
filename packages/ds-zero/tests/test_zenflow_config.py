"""zero_optimization.zenflow: DeepSpeed 0.19.8's keys and defaults, what it refuses refused here (named, with what
is allowed), and what ZenFlow needs of the rest of the configuration checked before any collective."""

from __future__ import annotations

import pytest
import torch
from ds_config import ConfigError
from torch import nn

import ds_comm
from ds_zero import ZeroConfig, ZeroOptimizer

# DeepSpeed 0.19.8's ZenFlowConfig() (deepspeed/runtime/zenflow/zenflow_config.py), read off an instance there
DEEPSPEED_DEFAULTS = {"topk_ratio": 0.1, "select_strategy": "auto", "select_interval": "auto",
                      "update_interval": "auto", "overlap_step": False, "offload": False, "auto_ratio": 0.99,
                      "full_warm_up_rounds": 0, "pt_reserved_cores_perc": 0.5, "steps_per_epoch": None}


def _zenflow(**keys):
    return ZeroConfig.model_validate({"stage": 2, "zenflow": keys}).zenflow


def test_every_key_and_default_is_deepspeeds():
    config = _zenflow()
    assert {name: getattr(config, name) for name in type(config).model_fields} == DEEPSPEED_DEFAULTS
    assert ZeroConfig().zenflow is None  # no section: ZenFlow is off, as in DeepSpeed
    example = _zenflow(topk_ratio=0.1, update_interval=4, full_warm_up_rounds=0, overlap_step=True)
    assert (example.update_interval, example.overlap_step, example.selection_interval()) == (4, True, 0)
    assert "steps_per_epoch" not in example.model_dump()  # set by the engine, never written back into a config


@pytest.mark.parametrize(("keys", "words"), [
    ({"topk_ratio": 0.0}, "topk_ratio"), ({"topk_ratio": 1.0}, "topk_ratio"), ({"topk_ratio": -0.5}, "topk_ratio"),
    ({"topk_ratio": 1.5}, "less than 1"),
    ({"select_strategy": "layer"}, "'auto', 'step' or 'epoch'"),
    ({"select_strategy": "step", "select_interval": "often"}, "select_interval"),
    ({"update_interval": "sometimes"}, "update_interval"),
    ({"update_interval": 0}, "zenflow.update_interval must be 'auto' or an integer >= 1, got 0"),
    ({"update_interval": -3}, "got -3"),
    ({"full_warm_up_rounds": 1.5}, "full_warm_up_rounds"),
    ({"full_warm_up_rounds": "two"}, "full_warm_up_rounds"),
    ({"auto_ratio": 1.5}, "auto_ratio"), ({"pt_reserved_cores_perc": -0.1}, "pt_reserved_cores_perc"),
    ({"overlap_step": "sometimes"}, "overlap_step"),
    ({"topk": 0.1}, "topk_ratio"),  # an unknown key: did you mean
    # what DeepSpeed refuses when it builds the optimizer
    ({"select_strategy": "auto", "select_interval": 4}, "zenflow.select_interval 4 with select_strategy 'auto'"),
    ({"select_strategy": "step"}, "zenflow.select_strategy 'step' needs an integer select_interval, got 'auto'"),
    ({"select_strategy": "epoch"}, "zenflow.select_strategy 'epoch' needs an integer select_interval"),
    ({"select_strategy": "step", "select_interval": 2, "update_interval": 4},
     "zenflow.select_interval (2 micro-steps) must be 0 or at least update_interval (4)"),
    ({"select_strategy": "epoch", "select_interval": 1, "update_interval": 4, "steps_per_epoch": 3},
     "zenflow.select_interval (3 micro-steps) must be 0 or at least update_interval (4)"),
    # refused by ds only (DeepSpeed takes them; a README row says why)
    ({"select_strategy": "step", "select_interval": -1}, "zenflow.select_interval must be 'auto' or an integer >= 0"),
    ({"full_warm_up_rounds": -1}, "full_warm_up_rounds"),
])
def test_bad_values_are_refused_by_name(keys, words):
    with pytest.raises(ConfigError) as error:
        _zenflow(**keys)
    assert words in str(error.value)
    assert "zenflow" in str(error.value)


def test_selection_interval_resolves_deepspeeds_strategies():
    assert _zenflow(select_strategy="step", select_interval=8, update_interval=4).selection_interval() == 8
    assert _zenflow(select_strategy="step", select_interval=0, update_interval=4).selection_interval() == 0
    assert _zenflow(steps_per_epoch=8).selection_interval() == 8  # auto: every epoch
    assert _zenflow(select_strategy="epoch", select_interval=2, steps_per_epoch=5).selection_interval() == 10
    assert _zenflow(select_strategy="epoch", select_interval=2).selection_interval() == 0  # no loader: once


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))


EXAMPLE = {"topk_ratio": 0.1, "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}


@pytest.mark.parametrize(("config", "bf16", "error", "words"), [
    ({"stage": 2, "zenflow": EXAMPLE}, True, ValueError,
     "zero_optimization.zenflow needs offload_optimizer.device 'cpu' (ZenFlow steps the unselected columns there), "
     "got 'none'"),
    ({"stage": 3, **OFFLOAD, "zenflow": EXAMPLE}, True, NotImplementedError, "zenflow at stage 3 is not implemented"),
    ({"stage": 1, **OFFLOAD, "zenflow": EXAMPLE}, True, NotImplementedError, "zenflow at stage 1 is not implemented"),
    ({"stage": 2, **OFFLOAD, "compute_grad_norm": False, "zenflow": EXAMPLE}, True, ValueError,
     "compute_grad_norm false cannot be used with zenflow"),
    ({"stage": 2, **OFFLOAD, "zenflow": {**EXAMPLE, "offload": True}}, True, ValueError,
     "zenflow.offload true needs zero_optimization.overlap_comm true"),
    ({"stage": 2, **OFFLOAD, "zenflow": {**EXAMPLE, "update_interval": "auto"}}, True, NotImplementedError,
     "zenflow.update_interval 'auto' is not implemented"),
    ({"stage": 2, **OFFLOAD, "zenflow": EXAMPLE}, False, NotImplementedError,
     "zenflow with fp32 training is not implemented"),
])
def test_what_zenflow_needs_is_named_before_any_collective(config, bf16, error, words):
    assert not ds_comm.is_initialized()
    with pytest.raises(error) as raised:
        ZeroOptimizer(_model(), torch.optim.AdamW, config=config, bf16={"enabled": bf16})
    assert words in str(raised.value)
