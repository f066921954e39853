"""ds-nvme-tune on a tiny sweep: progress, best GB/s, a recommended aio block that loads."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ds_io import AioConfig
from ds_io.tune import Result, _count_progress, load_sweep, main, parse_size, tune

TINY = {"block_size": ["64K", 131072], "queue_depth": [4], "thread_count": [1, 2], "overlap_events": [True]}


def test_tiny_sweep_reports_every_config_and_the_best(tmp_path):
    seen = []
    report = tune([tmp_path], TINY, io_size="1M", progress=lambda i, n, r: seen.append((i, n)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert len(report.results) == 4
    assert all(r.read_gbps > 0 and r.buffered_read_gbps > 0 for r in report.results)
    assert report.best_read_gbps == max(max(r.read_gbps, r.buffered_read_gbps) for r in report.results) > 0
    assert report.best_write_gbps == max(r.write_gbps for r in report.results) > 0
    # the recommendation maximises the faster read path plus the write speed
    best = max(report.results, key=lambda r: max(r.read_gbps, r.buffered_read_gbps) + r.write_gbps)
    assert report.recommended == best.config()
    assert report.buffered_reads == (best.buffered_read_gbps > best.read_gbps)
    assert list(tmp_path.iterdir()) == []  # the test files are removed


def test_buffered_reads_can_be_left_out(tmp_path):
    report = tune([tmp_path], {"block_size": [65536], "queue_depth": [4], "intra_op_parallelism": [1],
                               "overlap_events": [True]}, buffered_read=False, io_size=65536, progress=None)
    assert report.results[0].buffered_read_gbps is None and report.buffered_reads is False


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
    with pytest.raises(ValueError, match="sweep config: blocksize: unknown key 'blocksize'; did you mean 'block_size'"):
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


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


@pytest.mark.parametrize("tty", [True, False])
def test_progress_uses_carriage_returns_only_on_a_terminal(tty):
    stream = _Stream(tty)
    show = _count_progress(stream)
    for k in (1, 2, 3):
        show(k, 3, Result(65536, 4, 1, False, True))
    if tty:
        assert stream.getvalue() == ("\rds-nvme-tune: 1/3 configurations\rds-nvme-tune: 2/3 configurations"
                                     "\rds-nvme-tune: 3/3 configurations\n")
    else:
        assert stream.getvalue() == "".join(f"ds-nvme-tune: {k}/3 configurations\n" for k in (1, 2, 3))


def _cli(tmp_path, *extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # SIGINT as a terminal gives it: a test run started in the background of a shell without job control
    # inherits SIGINT ignored, and the Ctrl-C test's signal would then do nothing
    return subprocess.Popen([sys.executable, "-m", "ds_io.tune", "--nvme_dir", str(tmp_path), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_progress_in_a_log_file_is_one_line_per_configuration(tmp_path):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"block_size": ["64K"], "queue_depth": [2, 4, 8], "io_parallel": [1],
                                 "overlap_events": [True]}))
    (tmp_path / "d").mkdir()
    proc = _cli(tmp_path / "d", "--sweep_config", str(sweep), "--io_size", "256K", "--no_buffered_read")
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "\r" not in err
    assert [line for line in err.splitlines() if "configurations" in line] == [
        f"ds-nvme-tune: {k}/3 configurations" for k in (1, 2, 3)]


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path):
    sweep = tmp_path / "sweep.json"  # long enough never to finish before the signal
    sweep.write_text(json.dumps({"block_size": ["64K", "128K", "256K"], "queue_depth": list(range(1, 201)),
                                 "io_parallel": [1], "overlap_events": [True]}))
    (tmp_path / "d").mkdir()
    proc = _cli(tmp_path / "d", "--sweep_config", str(sweep), "--io_size", "1M")
    first = ""
    deadline = time.monotonic() + 120
    while "configurations" not in first and time.monotonic() < deadline:  # started measuring
        first = proc.stderr.readline()
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines()[-1] == "ds-nvme-tune: interrupted"
    assert list((tmp_path / "d").iterdir()) == []  # its test files are removed
