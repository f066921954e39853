"""`ds-launch --autotuning tune|run` hands the command line to the `ds-autotune` command (ds-autotune's own
tests cover the search); without that command it names the package to install, and launches nothing."""

from __future__ import annotations

import json

from ds_launch.cli import main


def test_ds_launch_names_the_package_when_ds_autotune_is_missing(tmp_path, monkeypatch, capsys):
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "autotuning": {"enabled": True}}))
    script = tmp_path / "train.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.setenv("PATH", str(tmp_path))  # no ds-autotune command on it
    assert main(["--num_gpus", "2", "--autotuning", "tune", str(script), "--deepspeed_config", str(config)]) == 2
    assert "pip install ds-autotune" in capsys.readouterr().err
    assert not marker.exists()
