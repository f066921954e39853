"""DeepSpeed's ``deepspeed.launcher.runner`` and ``deepspeed.autotuning`` paths under ds_all: ds-launch's parser
and ds-autotune's objects at DeepSpeed's names and signatures (``Autotuner(args, active_resources)``)."""

from __future__ import annotations

import json

import pytest

import ds_autotune
import ds_launch
from ds_all.autotuning import Autotuner, autotuner, scheduler, utils
from ds_all.launcher import runner


def test_the_paths_are_the_owners_objects():
    assert runner.parse_args is ds_launch.parse_deepspeed_args
    assert issubclass(autotuner.Autotuner, ds_autotune.Autotuner) and Autotuner is autotuner.Autotuner
    assert scheduler.ResourceManager is ds_autotune.ResourceManager
    assert (utils.get_val_by_key, utils.set_val_by_key) == (ds_autotune.get_val_by_key, ds_autotune.set_val_by_key)


@pytest.mark.parametrize("argv, active, nodes, gpus", [
    ([], {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1]}, 2, 2),
    (["--num_nodes", "1"], {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1]}, 1, 2),
    (["--num_gpus", "1"], {"worker-0": [0, 1], "worker-2": [4, 5]}, 2, 1),
])
def test_autotuner_from_the_launchers_command_line(tmp_path, argv, active, nodes, gpus):
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"autotuning": {"enabled": True, "exps_dir": str(tmp_path / "exps"),
                                                 "results_dir": str(tmp_path / "results"), "arg_mappings": {}}}))
    args = runner.parse_args([*argv, "--autotuning", "tune", "train.py", "--deepspeed_config", str(config)])
    tuner = Autotuner(args=args, active_resources=active)
    assert (tuner.exp_num_nodes, tuner.exp_num_gpus, tuner.args) == (nodes, gpus, args)
    assert (tmp_path / "exps").is_dir() and (tmp_path / "results").is_dir()
    tuner.print_tuning_results()  # nothing ran yet: an empty table, and the summary file
    assert "no optimal setup found" in (tmp_path / "results" / "summary.txt").read_text()
    tuner.write_optimal_config()  # no best: nothing written
    assert not (tmp_path / "results" / "ds_config_optimal.json").exists()


def test_runner_main_launches_and_exits_with_the_launchs_code(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    assert runner.main(["--dry_run", str(script)]) is None
    assert "dry run" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        runner.main(["--num_gpus", "0", str(script)])
    assert e.value.code == 2 and "--num_gpus" in capsys.readouterr().err
