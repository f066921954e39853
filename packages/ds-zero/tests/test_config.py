"""zero_optimization, fp16 and bf16: DeepSpeed's keys and defaults, the shared configs, Hugging Face's
"auto", deprecated spellings, and contradictions named."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from ds_config import ConfigError

from ds_zero import BF16Config, FP16Config, OffloadOptimizerConfig, ZeroConfig
from ds_zero.config import mixed_precision

CONFIGS = Path(__file__).resolve().parents[2] / "ds-all" / "tests" / "fixtures" / "deepspeed_configs"


def test_defaults_are_deepspeeds():
    z = ZeroConfig()
    assert (z.stage, z.contiguous_gradients, z.overlap_comm, z.reduce_scatter, z.reduce_bucket_size,
            z.allgather_partitions, z.allgather_bucket_size, z.round_robin_gradients, z.load_from_fp32_weights,
            z.elastic_checkpoint, z.ignore_unused_parameters, z.sub_group_size, z.offload_optimizer,
            z.offload_param) == (0, True, False, True, 500_000_000, True, 500_000_000, False, True, False, True,
                                 1_000_000_000, None, None)
    assert (z.prefetch_bucket_size, z.param_persistence_threshold, z.model_persistence_threshold,
            z.max_live_parameters, z.max_reuse_distance, z.gather_16bit_weights_on_model_save) == (
        50_000_000, 100_000, sys.maxsize, 1_000_000_000, 1_000_000_000, False)
    o = OffloadOptimizerConfig()
    assert (o.device, o.nvme_path, o.buffer_count, o.pin_memory, o.pipeline_read, o.pipeline_write,
            o.fast_init, o.ratio) == ("none", None, 4, False, False, False, False, 1.0)
    f = FP16Config()
    assert (f.enabled, f.auto_cast, f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis,
            f.consecutive_hysteresis, f.min_loss_scale) == (False, False, 0.0, 16, 1000, 2, False, 1.0)
    assert f.dynamic and not FP16Config(loss_scale=128).dynamic
    assert BF16Config().enabled is False


def test_overlap_comm_default_follows_the_stage():
    assert [ZeroConfig(stage=s).overlap for s in range(4)] == [False, False, False, True]
    assert ZeroConfig(stage=3, overlap_comm=False).overlap is False
    assert ZeroConfig(stage=1, overlap_comm=True).overlap is True


@pytest.mark.parametrize("name", ["zero1_fp16", "zero2_offload", "zero3_nvme", "zero3_offload"])
def test_shared_configs_load_key_for_key(name):
    path = CONFIGS / f"{name}.json"
    whole = json.loads(path.read_text())
    z = ZeroConfig.from_ds_config(path)
    dumped = z.to_ds_config()["zero_optimization"]
    for key, value in whole["zero_optimization"].items():
        if isinstance(value, dict):
            assert {k: dumped[key][k] for k in value} == value, key
        else:
            assert dumped[key] == value, key
    assert mixed_precision(FP16Config.from_ds_config(path), BF16Config.from_ds_config(path)) == (
        "fp16" if whole.get("fp16", {}).get("enabled") else "bf16" if whole.get("bf16", {}).get("enabled") else "fp32")


def test_hugging_face_auto_values_are_kept_for_the_engine_to_resolve():
    z = ZeroConfig.model_validate({"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                   "stage3_param_persistence_threshold": "auto"})
    assert (z.reduce_bucket_size, z.prefetch_bucket_size, z.param_persistence_threshold) == ("auto",) * 3
    assert FP16Config(enabled="auto").enabled == "auto"
    with pytest.raises(ValueError, match=r'fp16\.enabled is "auto"'):
        mixed_precision(FP16Config(enabled="auto"))
    with pytest.raises(ConfigError, match=r"zero_optimization\.allgather_bucket_size: must be an integer, got 'auto'"):
        ZeroConfig(allgather_bucket_size="auto")  # DeepSpeed has no "auto" there either


def test_stage3_keys_by_deepspeed_name_and_short_name():
    a = ZeroConfig(stage=3, stage3_max_live_parameters=1e6)
    b = ZeroConfig(stage=3, max_live_parameters=1_000_000)
    assert a == b and a.max_live_parameters == 1_000_000
    assert a.to_ds_config()["zero_optimization"]["stage3_max_live_parameters"] == 1_000_000


def test_deprecated_spellings_map_to_the_current_keys(caplog):
    with caplog.at_level(logging.WARNING, logger="ds_zero.config"):
        z = ZeroConfig(stage=2, cpu_offload=True, cpu_offload_use_pin_memory=True)
    assert z.offload_optimizer == OffloadOptimizerConfig(device="cpu", pin_memory=True)
    assert "cpu_offload is deprecated; use offload_optimizer" in caplog.text
    assert ZeroConfig(stage=2, cpu_offload=False).offload_optimizer is None
    z = ZeroConfig(stage=3, stage3_gather_fp16_weights_on_model_save=True)
    assert z.gather_16bit_weights_on_model_save is True
    with pytest.raises(ConfigError, match="not both"):
        ZeroConfig(stage=2, cpu_offload=True, offload_optimizer={"device": "cpu"})
    # DeepSpeed refuses a deprecated key with its replacement whatever the values, even equal ones
    for data in ({"stage3_gather_fp16_weights_on_model_save": True, "stage3_gather_16bit_weights_on_model_save": True},
                 {"stage3_gather_fp16_weights_on_model_save": True, "gather_16bit_weights_on_model_save": True},
                 {"cpu_offload": False, "offload_optimizer": {"device": "cpu"}},
                 {"cpu_offload_param": False, "offload_param": {"device": "cpu"}}):
        old = next(iter(data))
        with pytest.raises(ConfigError, match=f"give '{old}' \\(deprecated\\) or '.*', not both"):
            ZeroConfig(stage=3, **data)


def test_overlap_comm_reads_deepspeeds_dynamic_default():
    # DeepSpeed's config tests read the key itself: False at stages 0-2, True at 3 when not given
    assert [ZeroConfig(stage=s).overlap_comm for s in range(4)] == [False, False, False, True]
    assert ZeroConfig(stage=3, overlap_comm=False).overlap_comm is False


def test_deepspeed_0_19_keys_are_known():
    z = ZeroConfig(stage=2, compute_grad_norm=False, stage3_allgather_sequential=True, parameter_alignment=True,
                   enable_sanity_checks=True, save_muon_momentum_buffer_in_memory=True, zero_hpz_partition_size=0,
                   leaf_module={"classes": ["MyBlock"], "names": ["model.layers.0"], "name_suffixes": ["mlp"]},
                   offload_optimizer={"device": "cpu", "super_offload": False, "cpuadam_cores_perc": 0.5})
    assert z.allgather_sequential and z.leaf_module.names == ["model.layers.0"]
    assert z.offload_optimizer.cpuadam_cores_perc == 0.5
    with pytest.raises(ConfigError, match=r"compute_grad_norm false is allowed only at stage 1 or 2.*got stage 3"):
        ZeroConfig(stage=3, compute_grad_norm=False)
    with pytest.raises(ConfigError, match=r"leaf_module\.class: unknown key 'class'; did you mean 'classes'"):
        ZeroConfig(stage=3, leaf_module={"class": ["X"]})
    b = BF16Config(enabled=True, bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    assert b.check_grad_overflow is True and BF16Config(check_grad_overflow=False).check_grad_overflow is False
    with pytest.raises(ConfigError, match=r"bf16_optimizer_states needs bf16\.bf16_master_weights_and_grads"):
        BF16Config(enabled=True, bf16_optimizer_states=True)


def test_stage3_keys_below_stage_3_are_said_to_be_ignored(caplog):
    with caplog.at_level(logging.WARNING, logger="ds_zero.config"):
        ZeroConfig(stage=2, stage3_max_live_parameters=3, reduce_bucket_size=4)
    assert "stage3_max_live_parameters only read at stage 3; ignored at stage 2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ds_zero.config"):
        ZeroConfig(stage=3, stage3_max_live_parameters=3)
    assert caplog.text == ""


@pytest.mark.parametrize(("data", "message"), [
    ({"stage": 4}, "zero_optimization.stage must be 0, 1, 2 or 3, got 4"),
    ({"stage": "2"}, "zero_optimization.stage: must be an integer, got '2'"),
    ({"stgae": 2}, "zero_optimization.stgae: unknown key 'stgae'; did you mean 'stage'?"),
    ({"reduce_bucket_size": 0}, "zero_optimization.reduce_bucket_size: must be greater than 0 or 'auto', got 0"),
    ({"allgather_bucket_size": -1}, "zero_optimization.allgather_bucket_size: must be greater than 0, got -1"),
    ({"reduce_bucket_size": 5.5e8 + 0.5}, "zero_optimization.reduce_bucket_size: must be an integer or 'auto'"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer needs stage 1, 2 or 3"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}, "'nvme' (ZeRO-Infinity) needs stage 3"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param needs stage 3"),
    ({"stage": 3, "offload_param": {"device": "nvme"}}, "zero_optimization.offload_param: nvme_path is required"),
    ({"stage": 1, "offload_optimizer": {"device": "gpu"}}, "zero_optimization.offload_optimizer.device: must be 'none', 'cpu' or 'nvme', got 'gpu'"),
    ({"stage": 1, "offload_optimizer": {"devcie": "cpu"}}, "zero_optimization.offload_optimizer.devcie: unknown key 'devcie'; did you mean 'device'?"),
    ({"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}, "zero_optimization.offload_optimizer.ratio: must be less than or equal to 1"),
    ({"stage": 3, "stage3_max_live_parameters": -1}, "zero_optimization.stage3_max_live_parameters: must be greater than or equal to 0, got -1"),
    ({"stage": 3, "stage3_max_live_parameter": 1}, "did you mean 'stage3_max_live_parameters'?"),
    ({"cpu_offload": "yes"}, "cpu_offload must be true or false, got 'yes'"),
])
def test_bad_values_are_named(data, message):
    with pytest.raises(ConfigError) as info:
        ZeroConfig.model_validate(data)
    assert message in str(info.value)


@pytest.mark.parametrize(("section", "data", "message"), [
    (FP16Config, {"loss_scale": -1}, "fp16.loss_scale: must be greater than or equal to 0"),
    (FP16Config, {"hysteresis": 0}, "fp16.hysteresis: must be greater than 0, got 0"),
    (FP16Config, {"loss_scale_window": 1.5}, "fp16.loss_scale_window: must be an integer, got 1.5"),
    (FP16Config, {"min_loss_scale": 0}, "fp16.min_loss_scale: must be greater than 0"),
    (FP16Config, {"initial_scale_power": 65}, "fp16.initial_scale_power: must be less than or equal to 64"),
    (FP16Config, {"enabled": "yes"}, "fp16.enabled: must be true or false or 'auto', got 'yes'"),
    (FP16Config, {"loss_scale_windw": 2}, "did you mean 'loss_scale_window'?"),
    (BF16Config, {"enable": True}, "bf16.enable: unknown key 'enable'; did you mean 'enabled'?"),
])
def test_bad_precision_values_are_named(section, data, message):
    with pytest.raises(ConfigError) as info:
        section.model_validate(data)
    assert message in str(info.value)


def test_fp16_and_bf16_together_is_a_contradiction():
    assert mixed_precision() == "fp32"
    assert mixed_precision(FP16Config(enabled=True)) == "fp16"
    assert mixed_precision(bf16=BF16Config(enabled="true")) == "bf16"
    with pytest.raises(ValueError, match=r"fp16\.enabled and bf16\.enabled are both true"):
        mixed_precision(FP16Config(enabled=True), BF16Config(enabled=True))
