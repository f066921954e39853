"""``ds-autotune`` (and ``ds-launch --autotuning``) end to end on 2 ranks through ds-launch, with a stand-in
script (``_fake_train.py``, standard library only) whose metric is a known function of stage and micro-batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ds_autotune
from ds_autotune.cli import main

FAKE = str(Path(__file__).with_name("_fake_train.py"))


def test_public_names():
    assert sorted(ds_autotune.__all__) == ["Autotuner", "AutotuningConfig", "BaseTuner", "GridSearchTuner",
                                           "ModelBasedTuner", "RandomTuner", "ResourceManager", "get_val_by_key",
                                           "instantiation_memory", "launcher_options", "prune", "set_val_by_key",
                                           "write_atomic"]


def _expected(stage, mbs):  # the stand-in's throughput
    return mbs * 1000 / (mbs + 4) / (1 + 0.1 * stage)


def _setup(tmp_path, monkeypatch, **autotuning):
    cfg = {"train_micro_batch_size_per_gpu": [2, 8], "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "autotuning": {"enabled": True, "results_dir": str(tmp_path / "results"),
                          "exps_dir": str(tmp_path / "exps"), "tuner_type": "gridsearch", **autotuning}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    monkeypatch.setenv("FAKE_TRAIN_LOG", str(tmp_path / "runs.log"))
    monkeypatch.setenv("FAKE_TRAIN_DONE", str(tmp_path / "done.json"))
    return str(path)


def _runs(tmp_path):
    return [json.loads(line) for line in (tmp_path / "runs.log").read_text().splitlines()]


def test_tune_prunes_runs_and_writes_results(tmp_path, monkeypatch):
    cfg = _setup(tmp_path, monkeypatch)
    # 19 MB per rank: stage 0 and 1 at micro-batch 8 cannot fit (see test_config_space)
    assert main(["tune", "--num_gpus", "2", "--memory_per_gpu", "19000000", FAKE, "--deepspeed_config", cfg]) == 0
    runs = _runs(tmp_path)
    assert runs[0]["profile"] and runs[0]["stage"] == 3 and runs[0]["mbs"] == 1  # the model-info run
    ran = sorted((r["stage"], r["mbs"]) for r in runs[1:])
    assert ran == [(0, 2), (1, 2), (2, 2), (2, 8), (3, 2), (3, 8)]  # the pruned ones never ran
    results = tmp_path / "results"
    summary = (results / "summary.txt").read_text()
    assert "z2_gas1_tmbspg8 is the optimal setup" in summary
    assert summary.count("pruned") >= 2 and "z0_gas1_tmbspg8" in summary
    data = json.loads((results / "results.json").read_text())
    for record in data["experiments"]:
        if record["status"] == "ok":
            z = record["ds_config"]
            assert record["metric"] == pytest.approx(_expected(z["zero_optimization"]["stage"],
                                                              z["train_micro_batch_size_per_gpu"]))
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal["zero_optimization"]["stage"] == 2 and optimal["train_micro_batch_size_per_gpu"] == 8
    assert "autotuning" not in optimal
    assert (tmp_path / "exps" / "z2_gas1_tmbspg8.json").is_file()
    assert "ds_config_optimal.json" in (results / "cmd_optimal.txt").read_text()
    leftovers = [p for p in results.rglob("*.tmp")]
    assert leftovers == []


def test_run_trains_with_the_best_config_via_ds_launch(tmp_path, monkeypatch):
    # ds-launch --autotuning run: ds-autotune tunes (model info given: no profile run), then trains
    cfg = _setup(tmp_path, monkeypatch, tuner_type="model_based", model_info={"num_params": 1000})
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    out = subprocess.run([sys.executable, "-m", "ds_launch", "--num_gpus", "2", "--autotuning", "run", FAKE,
                          "--deepspeed_config", cfg], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "running z0_gas1_tmbspg8" in out.stderr  # progress is visible
    runs = _runs(tmp_path)
    assert not any(r["profile"] for r in runs)
    assert runs[-1] == {"enabled": False, "stage": 0, "mbs": 8, "profile": False}  # the training run
    assert json.loads((tmp_path / "done.json").read_text()) == {"stage": 0, "mbs": 8, "gas": 1}


def test_failed_runs_are_recorded_not_best(tmp_path, monkeypatch):
    cfg = _setup(tmp_path, monkeypatch, model_info={"num_params": 1000}, overwrite=True)
    monkeypatch.setenv("FAKE_TRAIN_FAIL_MBS", "8")
    with open(cfg) as f:
        data = json.load(f)
    data["zero_optimization"] = {"stage": 1}
    with open(cfg, "w") as f:
        json.dump(data, f)
    assert main(["--num_gpus", "2", FAKE, "--deepspeed_config", cfg]) == 0
    records = json.loads((tmp_path / "results" / "results.json").read_text())
    status = {r["name"]: r["status"] for r in records["experiments"]}
    assert status == {"z1_gas4_tmbspg2": "ok", "z1_gas1_tmbspg8": "failed"}
    assert records["best"]["name"] == "z1_gas4_tmbspg2"
    assert "out of memory" in (tmp_path / "results" / "z1_gas1_tmbspg8" / "stderr.log").read_text()


def test_bad_autotuning_value_is_named(tmp_path, monkeypatch, capsys):
    cfg = _setup(tmp_path, monkeypatch, metric="speed")
    assert main([FAKE, "--deepspeed_config", cfg]) == 2
    err = capsys.readouterr().err
    assert "autotuning.metric" in err and "'speed'" in err and "'throughput'" in err


def test_script_without_config_is_an_error(tmp_path, capsys):
    assert main([FAKE, "--steps", "3"]) == 2
    assert "--deepspeed_config" in capsys.readouterr().err
