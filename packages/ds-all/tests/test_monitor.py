"""Monitors from the config: an engine on 2 ranks writes loss, lr, grad norm and samples/s to CSV,
TensorBoard and Weights & Biases (offline, no network) from rank 0 only; each file read back
against what the engine reported at each step."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from torch import nn

import ds_all
from ds_comm.testing import spawn

STEPS = 4


def train_with_monitors(rank, world_size, out):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    config = {"train_batch_size": 8, "steps_per_print": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 3,
                                                           "warmup_type": "linear"}},
              "csv_monitor": {"enabled": True, "output_path": f"{out}/csv", "job_name": "job"},
              "tensorboard": {"enabled": True, "output_path": f"{out}/tb", "job_name": "job"},
              "wandb": {"enabled": True, "project": "ds-test"}}
    engine, *_ = ds_all.initialize(model=model, config=config)
    reported = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step * 10 + rank)
        loss = nn.functional.mse_loss(engine(torch.randn(4, 4, generator=g)), torch.randn(4, 1, generator=g))
        engine.backward(loss)
        engine.step()
        reported.append((engine.global_samples, loss.item(), engine.get_lr()[0], engine.get_global_grad_norm()))
    paths = engine.monitor.paths()
    wandb_summary = {}
    if rank == 0:
        run = engine.monitor.monitors[2].run
        wandb_summary = {"loss": run.summary["Train/Samples/train_loss"], "lr": run.summary["Train/Samples/lr"],
                         "step": run.summary["_step"]}
    engine.destroy()
    return reported, paths, wandb_summary


def _csv(path: Path) -> list[tuple[int, float]]:
    with open(path) as f:
        rows = list(csv.reader(f))
    return [(int(step), float(value)) for step, value in rows[1:]]


def _same(rows: list[tuple[int, float]], steps: list[int], values: list[float]) -> None:
    assert [step for step, _ in rows] == steps
    assert [value for _, value in rows] == pytest.approx(values, rel=1e-6)


def test_csv_tensorboard_and_wandb_get_the_engines_scalars(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install ds-all[monitors])")
    pytest.importorskip("wandb", reason="wandb is not installed (pip install ds-all[monitors])")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb").mkdir()
    (reported, paths, summary), (_, other_paths, _) = spawn(train_with_monitors, world_size=2, args=(str(tmp_path),), timeout=240)
    assert other_paths == {} and sorted(paths) == ["csv_monitor", "tensorboard", "wandb"]  # rank 0 writes
    samples = [r[0] for r in reported]
    assert samples == [8, 16, 24, 32]

    folder = tmp_path / "csv" / "job"
    for name, column in (("train_loss", 1), ("lr", 2), ("grad_norm", 3)):
        _same(_csv(folder / f"Train_Samples_{name}.csv"), samples, [r[column] for r in reported])
    rates = _csv(folder / "Train_Samples_samples_per_sec.csv")
    assert [s for s, _ in rates] == samples and all(rate > 0 for _, rate in rates)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb" / "job"))
    events.Reload()
    _same([(e.step, e.value) for e in events.Scalars("Train/Samples/train_loss")], samples, [r[1] for r in reported])

    # wandb's run saw the last step's values (offline: its .wandb file, a protobuf log, holds the rows)
    assert summary == {"loss": pytest.approx(reported[-1][1]), "lr": pytest.approx(reported[-1][2]),
                       "step": samples[-1]}
    (log,) = Path(paths["wandb"]).glob("*.wandb")
    assert b"Train/Samples/train_loss" in log.read_bytes()


def test_a_monitor_without_its_package_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed: importing it fails
    config = ds_all.Config.load({"wandb": {"enabled": True}})
    with pytest.raises(ImportError, match=r"wandb.enabled is true but the wandb package is not installed"):
        ds_all.monitor.Monitors(config)


def test_no_monitor_enabled_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # restored after the test: later tests keep their working directory
    monitors = ds_all.monitor.Monitors(ds_all.Config.load({}))
    assert not monitors.enabled and monitors.paths() == {}
    monitors.write_events([("Train/Samples/lr", 1.0, 1)])
    assert list(tmp_path.iterdir()) == []
