"""DeepSpeed's ``deepspeed.autotuning.autotuner``: ``Autotuner(args, active_resources)``, ds-autotune's
`Autotuner` built from a launcher's parsed command line (``deepspeed.launcher.runner.parse_args``) and the
resources the launcher selected (host -> slot ids)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ds_autotune

__all__ = ["Autotuner"]


class Autotuner(ds_autotune.Autotuner):
    """DeepSpeed's constructor and methods over ds-autotune's `Autotuner`: ``tune()``,
    ``print_tuning_results()``, ``write_optimal_config()``, ``run_after_tuning()``. Each experiment runs on ``exp_num_nodes`` nodes x ``exp_num_gpus`` slots:
    ``args.num_nodes``/``args.num_gpus`` when given (> 0), else every host of ``active_resources`` with as many
    slots as the smallest of them has (more than that is a ``ValueError``)."""

    def __init__(self, args: Any, active_resources: Mapping[str, Sequence[int]]) -> None:
        super().__init__(**ds_autotune.launcher_options(args, active_resources))
        self.args = args

    def print_tuning_results(self) -> None:
        """Print the table of the experiments (best first) and write it to ``results_dir``/summary.txt (with
        results.json beside it)."""
        print(self.write_summary())
