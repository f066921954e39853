"""ds-nvme-tune on a tiny sweep: progress, best GB/s, a recommended aio block that loads."""

from __future__ import annotations

import json

import pytest

from ds_io import AioConfig
from ds_io.tune import load_sweep, main, parse_size, tune

TINY = {"block_size": ["64K", 131072], "queue_depth": [4], "thread_count": [1, 2], "overlap_events": [True]}


def test_tiny_sweep_reports_every_config_and_the_best(tmp_path):
    seen = []
    report = tune([tmp_path], TINY, io_size="1M", progress=lambda i, n, r: seen.append((i, n)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert len(report.results) == 4
    assert report.best_read_gbps == max(r.read_gbps for r in report.results) > 0
    assert report.best_write_gbps == max(r.write_gbps for r in report.results) > 0
    best = max(report.results, key=lambda r: r.read_gbps + r.write_gbps)
    assert report.recommended == best.config()
    assert list(tmp_path.iterdir()) == []  # the test files are removed


def test_cli_prints_and_writes_the_aio_block(tmp_path, capsys):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"block_size": ["64K"], "queue_depth": [2, 8], "io_parallel": [1],
                                 "overlap_events": [False]}))
    (tmp_path / "d1").mkdir()
    (tmp_path / "d2").mkdir()
    out = tmp_path / "aio.json"
    code = main(["--nvme_dir", str(tmp_path / "d1"), str(tmp_path / "d2"), "--sweep_config", str(sweep),
                 "--io_size", "512K", "--loops", "2", "--output", str(out), "--log_dir", str(tmp_path / "logs"),
                 "--verbose"])
    captured = capsys.readouterr()
    assert code == 0
    assert "[  1/2] block_size=   65536 queue_depth=  2" in captured.err
    assert "Best performance (GB/sec): read = " in captured.out
    section = json.loads(out.read_text())
    config = AioConfig(**section["aio"])
    assert config.block_size == 65536 and config.queue_depth in (2, 8) and config.overlap_events is False
    assert json.loads(captured.out[captured.out.index("{"):]) == section
    log = json.loads((tmp_path / "logs" / "ds_nvme_tune.json").read_text())
    assert len(log["results"]) == 2 and log["recommended"] == section


def test_write_only_sweep(tmp_path):
    report = tune([tmp_path], {"block_size": [65536], "queue_depth": [4], "intra_op_parallelism": [1],
                               "overlap_events": [True]}, read=False, io_size=65536, progress=None)
    assert report.best_read_gbps is None and report.best_write_gbps > 0


def test_errors_name_the_value(tmp_path, capsys):
    with pytest.raises(ValueError, match="sweep config: unknown key 'blocksize'; did you mean 'block_size'"):
        load_sweep({"blocksize": [1]})
    with pytest.raises(ValueError, match="queue_depth"):
        load_sweep({"queue_depth": [0]})
    with pytest.raises(ValueError, match="io_size must be a positive number of bytes"):
        parse_size("12Q", "io_size")
    assert parse_size("1M") == 1 << 20 and parse_size(1e6) == 1_000_000 and parse_size("256K") == 262144
    with pytest.raises(ValueError, match="nothing to measure"):
        tune([tmp_path], read=False, write=False)
    assert main(["--nvme_dir", str(tmp_path / "missing")]) == 2
    assert f"--nvme_dir '{tmp_path / 'missing'}' is not a directory" in capsys.readouterr().err
