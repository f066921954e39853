"""The engine's side of autotuning: the ``autotuning`` section, the metric file written and the clean exit
after ``end_profile_step``, the model-info run, and a tiny tune end to end through
``ds-launch --autotuning`` (2 ranks, the real engine)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ds_all
from ds_all import Config
from ds_comm.testing import spawn

D_IN, D_HID = 32, 64
SCRIPT = str(Path(__file__).with_name("_autotune_train.py"))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.GELU(), nn.Linear(D_HID, D_IN))


def _train(rank, world_size, cfg, max_steps):
    torch.set_num_threads(1)
    model = _model()
    engine, _, _, _ = ds_all.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    forwards = 0
    try:
        for _ in range(max_steps):
            for _ in range(gas):
                x = torch.randn(micro, D_IN)
                forwards += 1
                engine.backward(((engine(x) - x) ** 2).mean())
                engine.step()
    except SystemExit as e:
        return {"exit": e.code, "steps": engine.global_steps, "forwards": forwards, "destroyed": engine.zero is None}
    engine.destroy()
    return {"exit": None, "steps": engine.global_steps, "forwards": forwards, "destroyed": True}


def test_section_keys_and_bad_values_are_named():
    c = Config.load({"train_batch_size": 4, "autotuning": {"enabled": False, "metric": "latency", "fast": False,
                                                           "tuner_type": "random", "model_info": {"profile": True}}})
    assert c.autotuning.metric == "latency" and c.autotuning.model_info.profile and not c.autotuning.enabled
    with pytest.raises(ValueError, match=r"autotuning.*metric"):
        Config.load({"train_batch_size": 4, "autotuning": {"metric": "speed"}})
    with pytest.raises(ValueError, match=r"end_profile_step 2 must not be less than start_profile_step 3"):
        Config.load({"train_batch_size": 4, "autotuning": {"start_profile_step": 3, "end_profile_step": 2}})
    with pytest.raises(ValueError, match=r"tuner_typ"):
        Config.load({"train_batch_size": 4, "autotuning": {"tuner_typ": "random"}})


@pytest.mark.parametrize("stage, gas", [(0, 1), (2, 2)])
def test_engine_writes_the_metric_and_exits_after_end_profile_step(tmp_path, stage, gas):
    path = tmp_path / "metrics.json"
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage},
           "autotuning": {"enabled": True, "start_profile_step": 2, "end_profile_step": 4, "metric_path": str(path)}}
    results = spawn(_train, world_size=2, args=(cfg, 20))
    # steps 3..5 timed; the run leaves right after step end_profile_step + 1 = 5, every rank, exit code 0
    assert results == [{"exit": 0, "steps": 5, "forwards": 5 * gas, "destroyed": True}] * 2
    m = json.loads(path.read_text())
    assert set(m) >= {"latency", "throughput", "FLOPS_per_gpu", "rank"} and m["rank"] == 0
    train_batch = 4 * gas * 2
    assert m["throughput"] == pytest.approx(train_batch * 1e6 / m["latency"])  # latency: microseconds per step
    # FLOPS: 3 x the forward's flops (two Linear layers: 2 flops per multiply-add, plus bias and GELU) per step
    macs = 4 * (D_IN * D_HID + D_HID * D_IN)
    flops_per_step = m["FLOPS_per_gpu"] * m["latency"] / 1e6
    assert 3 * gas * 2 * macs <= flops_per_step <= 3 * gas * 2 * macs * 1.1
    assert not list(tmp_path.glob(".*tmp"))


def test_model_info_run_writes_parameters_and_activation_memory(tmp_path):
    path = tmp_path / "model_info.json"
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3},
           "autotuning": {"enabled": True, "model_info": {"profile": True}, "model_info_path": str(path)}}
    results = spawn(_train, world_size=2, args=(cfg, 20))
    assert results == [{"exit": 0, "steps": 0, "forwards": 1, "destroyed": True}] * 2  # after one forward
    info = json.loads(path.read_text())
    reference = sum(p.numel() for p in _model().parameters())
    assert info["num_params"] == info["trainable_num_params"] == reference == 2 * D_IN * D_HID + D_HID + D_IN
    # the outputs autograd keeps, per sample, float32: Linear (64), GELU (64), Linear (32)
    assert info["activation_mem_per_gpu"] == (D_HID + D_HID + D_IN) * 4
    assert info["device_type"] == "cpu"


def test_disabled_autotuning_trains_normally():
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "autotuning": {"enabled": False, "start_profile_step": 0, "end_profile_step": 1}}
    assert spawn(_train, world_size=2, args=(cfg, 4)) == [{"exit": None, "steps": 4, "forwards": 4,
                                                           "destroyed": True}] * 2


def test_tiny_tune_end_to_end_through_ds_launch(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": [4], "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": [0, 2]},
           "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 2, "tuner_type": "gridsearch",
                          "results_dir": str(tmp_path / "results"), "exps_dir": str(tmp_path / "exps"),
                          "model_info": {"num_params": 4192}}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "ds_launch", "--num_gpus", "2", "--autotuning", "tune", SCRIPT,
                          "--deepspeed_config", str(path)], env=env, capture_output=True, text=True, timeout=180,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    ran = {r["name"]: r for r in results["experiments"]}
    assert set(ran) == {"z0_gas1_tmbspg4", "z2_gas1_tmbspg4"}
    assert all(r["status"] == "ok" and r["metric"] > 0 for r in ran.values())
    best = max(ran.values(), key=lambda r: r["metric"])
    assert results["best"]["name"] == best["name"]
    optimal = json.loads((tmp_path / "results" / "ds_config_optimal.json").read_text())
    assert optimal == {k: v for k, v in best["ds_config"].items() if k != "autotuning"}
    for r in ran.values():  # the engine measured the steps 2..3 and each run exited by itself
        m = json.loads((Path(r["result_dir"]) / "metrics.json").read_text())
        assert m["steps"] == 2 and m["throughput"] == pytest.approx(r["metric"])
