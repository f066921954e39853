"""Monitors: the scalars of training (loss, learning rate, loss scale, gradient norm, samples/s)
written by rank 0 to TensorBoard, Weights & Biases and CSV files, as the config's ``tensorboard``,
``wandb`` and ``csv_monitor`` sections ask. Each takes events ``(name, value, step)``; DeepSpeed's
names are used ("Train/Samples/train_loss", stepped by samples seen).

    monitors = ds_all.monitor.Monitors(config)         # the three sections of a ds_all.Config
    monitors.write_events([("Train/Samples/train_loss", 2.5, 64)])
    monitors.close()
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

Event = tuple[str, float, int]


def _require(module: str, section: str, package: str) -> Any:
    """``module`` imported, or an ImportError saying which section needs which package."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{section}.enabled is true but the {package} package is not installed: pip install "
                          f"{package} (or ds-all[monitors])") from e


class TensorBoardMonitor:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` into ``output_path/job_name``
    (``output_path`` empty: ``./runs``). Needs the ``tensorboard`` package."""

    section = "tensorboard"

    def __init__(self, section: Any) -> None:
        summary = _require("torch.utils.tensorboard", "tensorboard", "tensorboard")
        self.path = Path(section.output_path or "runs") / section.job_name
        self._writer = summary.SummaryWriter(log_dir=str(self.path))

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class CSVMonitor:
    """One CSV file per scalar, ``output_path/job_name/<name with / as _>.csv``, rows ``step,value``
    (``output_path`` empty: ``./csv_monitor``); each row is flushed as it is written."""

    section = "csv_monitor"

    def __init__(self, section: Any) -> None:
        self.path = Path(section.output_path or "csv_monitor") / section.job_name
        self.path.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, Any] = {}

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            if name not in self._files:
                handle = open(self.path / (name.replace("/", "_") + ".csv"), "w", newline="")  # noqa: SIM115
                csv.writer(handle).writerow(["step", name])
                self._files[name] = handle
            handle = self._files[name]
            csv.writer(handle).writerow([step, value])
            handle.flush()

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()


class WandbMonitor:
    """Weights & Biases: ``wandb.init(project=, group=, entity=team)``, then ``log({name: value},
    step=step)``; ``run`` is the wandb run. Offline when ``WANDB_MODE=offline`` (no network). Needs the
    ``wandb`` package."""

    section = "wandb"

    def __init__(self, section: Any) -> None:
        wandb = _require("wandb", "wandb", "wandb")
        self.run = wandb.init(project=section.project, group=section.group, entity=section.team, reinit="create_new")
        self.path = Path(self.run.dir).parent  # the run's folder (its .wandb file, files/, logs/)

    def write_events(self, events: list[Event]) -> None:
        rows: dict[int, dict[str, float]] = {}
        for name, value, step in events:
            rows.setdefault(step, {})[name] = value
        for step, row in sorted(rows.items()):  # one committed row per step (wandb holds an uncommitted one back)
            self.run.log(row, step=step, commit=True)

    def close(self) -> None:
        self.run.finish()


class Monitors:
    """The monitors ``config`` enables (a `ds_all.Config`, or anything with ``tensorboard``,
    ``csv_monitor`` and ``wandb`` sections); ``enabled`` is False when there are none. Only rank 0
    writes: build it with ``rank=`` the global rank and other ranks get no monitor."""

    def __init__(self, config: Any, rank: int = 0) -> None:
        self.monitors: list[Any] = []
        if rank == 0:
            for section, cls in ((config.tensorboard, TensorBoardMonitor), (config.csv_monitor, CSVMonitor),
                                 (config.wandb, WandbMonitor)):
                if section.enabled:
                    self.monitors.append(cls(section))

    @property
    def enabled(self) -> bool:
        return bool(self.monitors)

    def paths(self) -> dict[str, str]:
        """Where each monitor writes, by section name ("tensorboard", "csv_monitor", "wandb")."""
        return {m.section: os.fspath(m.path) for m in self.monitors}

    def write_events(self, events: list[Event]) -> None:
        for monitor in self.monitors:
            monitor.write_events(events)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
        self.monitors = []
