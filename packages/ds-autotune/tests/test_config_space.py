"""The autotuning section (documented defaults, bad values named), the memory arithmetic and pruning, the
experiments' configs, and atomic writes."""

import json
import os

import pytest

from ds_autotune import AutotuningConfig, _space, instantiation_memory, prune, write_atomic


def test_defaults_are_the_documented_ones():
    c = AutotuningConfig.from_dict({})
    assert (c.enabled, c.fast, c.results_dir, c.exps_dir, c.overwrite, c.metric, c.start_profile_step,
            c.end_profile_step, c.max_train_batch_size, c.mp_size, c.num_tuning_micro_batch_sizes, c.tuner_type,
            c.tuner_early_stopping, c.tuner_num_trials, c.arg_mappings) == (
        False, True, "autotuning_results", "autotuning_exps", False, "throughput", 3, 5, None, 1, 3, "model_based",
        5, 50, None)
    assert AutotuningConfig.from_dict({"results_dir": None}).results_dir == "autotuning_results"


@pytest.mark.parametrize("section, words", [
    ({"metric": "speed"}, ["autotuning.metric", "'speed'", "'throughput'", "'latency'", "'flops'"]),
    ({"tuner_type": "bayes"}, ["autotuning.tuner_type", "'bayes'", "'gridsearch'", "'random'", "'model_based'"]),
    ({"start_profile_step": -1}, ["autotuning.start_profile_step", "-1", ">= 0"]),
    ({"tuner_num_trials": 0}, ["autotuning.tuner_num_trials", "0", ">= 1"]),
    ({"fast": "yes"}, ["autotuning.fast", "'yes'", "true or false"]),
    ({"start_profile_step": 6, "end_profile_step": 5}, ["end_profile_step 5", "start_profile_step 6"]),
    ({"tuner_typ": "random"}, ["autotuning.tuner_typ", "did you mean 'tuner_type'"]),
    ({"model_info": {"num_param": 3}}, ["autotuning.model_info.num_param", "num_params"]),
    ({"arg_mappings": {"train_micro_batch_size_per_gpu": 4}}, ["autotuning.arg_mappings"]),
    ({"results_dir": ""}, ["autotuning.results_dir", "''"]),
    ({"max_train_micro_batch_size_per_gpu": 2, "min_train_micro_batch_size_per_gpu": 4},
     ["min_train_micro_batch_size_per_gpu 4", "max_train_micro_batch_size_per_gpu 2"]),
])
def test_bad_values_are_named(section, words):
    with pytest.raises(ValueError) as e:
        AutotuningConfig.from_dict(section)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_flops_metric_reads_deepspeeds_key_and_latency_is_lower_better():
    assert AutotuningConfig.from_dict({"metric": "FLOPS"}).metric_key == "FLOPS_per_gpu"
    assert not AutotuningConfig.from_dict({"metric": "latency"}).higher_is_better


def _reference_memory(n, stage, gpus, fp16):  # DeepSpeed's per-GPU arithmetic, written out
    params, grads, optim = n * (2 if fp16 else 4), n * (2 if fp16 else 4), n * (16 if fp16 else 8)
    return {0: params + grads + optim, 1: params + grads + optim / gpus, 2: params + (grads + optim) / gpus,
            3: (params + grads + optim) / gpus}[stage]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("fp16", [False, True])
def test_instantiation_memory_is_deepspeeds(stage, fp16):
    n, gpus = 10_000_000, 4
    assert instantiation_memory(n, stage, gpus, fp16=fp16) == pytest.approx(_reference_memory(n, stage, gpus, fp16))
    assert instantiation_memory(n, stage, gpus, fp16=fp16, mp_size=2) == pytest.approx(
        _reference_memory(n, stage, gpus, fp16) / 2)
    offloaded = instantiation_memory(n, stage, gpus, fp16=fp16, offload_optimizer=True)
    assert offloaded < instantiation_memory(n, stage, gpus, fp16=fp16)


def test_pruning_drops_what_does_not_fit():
    at = AutotuningConfig.from_dict({})
    user = {"train_micro_batch_size_per_gpu": [2, 8]}
    exps = [_space.make_experiment(user, at, stage=s, mbs=m, max_per_gpu=8, num_gpus=2, num_nodes=1)
            for s in (0, 1, 2, 3) for m in (2, 8)]
    info = {"num_params": 1_000_000, "activation_mem_per_gpu": 1_000_000}
    kept, pruned = prune(exps, info, 19_000_000, 2, False, 1)
    # needs: stage 0 16 MB, 1 12 MB, 2 10 MB, 3 8 MB of states, + 1 MB per sample
    assert sorted(e["name"] for e in pruned) == ["z0_gas1_tmbspg8", "z1_gas1_tmbspg8"]
    assert len(kept) == 6
    assert all(e["required_memory"] <= 19_000_000 for e in kept)


def test_experiment_configs_keep_samples_per_step():
    at = AutotuningConfig.from_dict({})
    user = {"train_micro_batch_size_per_gpu": [1, 4], "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": [0, 3], "offload_optimizer": {"device": "cpu"}},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.99]}}, "autotuning": {"enabled": True}}
    sizes = _space.micro_batch_sizes(user, at, 10_000)
    per_gpu = _space.max_train_batch_size_per_gpu(user, at, sizes, 2)
    assert sizes == [1, 4] and per_gpu == 8 and _space.user_stages(user) == [0, 3]
    exp = _space.make_experiment(user, at, stage=3, mbs=1, max_per_gpu=per_gpu, num_gpus=2, num_nodes=1)
    cfg = exp["ds_config"]
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == (1, 8, 16)
    assert cfg["zero_optimization"] == {"stage": 3} and "autotuning" not in cfg
    assert cfg["optimizer"]["params"]["betas"] == [0.9, 0.99]  # lists inside optimizer are kept
    assert exp["name"] == "z3_gas8_tmbspg1"
    off = _space.make_experiment(user, at, stage=2, mbs=4, max_per_gpu=8, num_gpus=2, num_nodes=1, offload=True)
    assert off["ds_config"]["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


def test_micro_batch_sizes_halve_down_from_what_fits():
    at = AutotuningConfig.from_dict({"max_train_micro_batch_size_per_gpu": 64, "num_tuning_micro_batch_sizes": 3})
    assert _space.micro_batch_sizes({}, at, 1000) == [16, 32, 64]
    assert _space.micro_batch_sizes({}, at, 40) == [10, 20, 40]
    assert _space.micro_batch_sizes({}, at, 0) == []
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu"):
        _space.micro_batch_sizes({"train_micro_batch_size_per_gpu": [0, 2]}, at, 10)
    with pytest.raises(ValueError, match=r"zero_optimization.stage .* 0-3"):
        _space.user_stages({"zero_optimization": {"stage": 4}})


def test_host_memory_from_meminfo(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:   8000000 kB\n")
    assert _space.host_memory_bytes(str(f)) == 8_000_000 * 1024
    assert _space.memory_per_rank({"device_type": "cpu"}, 2, str(f)) == 4_000_000 * 1024
    assert _space.memory_per_rank({"device_type": "cuda", "device_memory_per_gpu": 80}, 2, str(f)) == 80
    assert _space.host_memory_bytes("/proc/meminfo") > 0


def test_write_atomic_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "out" / "best.json"
    write_atomic(str(path), json.dumps({"v": 1}))
    assert json.loads(path.read_text()) == {"v": 1}
    write_atomic(str(path), json.dumps({"v": 2}))
    assert json.loads(path.read_text()) == {"v": 2}

    def broken(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(str(path), json.dumps({"v": 3}))
    assert json.loads(path.read_text()) == {"v": 2}  # the old file, whole
    assert os.listdir(path.parent) == ["best.json"]  # no temp file left
