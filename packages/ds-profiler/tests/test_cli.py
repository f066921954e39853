"""ds-profile: the command line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from _models import gpt_counts, mlp_counts

from ds_profiler.cli import main

MODELS = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from _models import GPT, MLP

    def mlp(hidden=32):
        return MLP(hidden=hidden)

    def gpt():
        return GPT()

    not_a_model = 3

    def returns_int():
        return 3
""")


@pytest.fixture
def models_file(tmp_path):
    from pathlib import Path

    path = tmp_path / "cli_models.py"
    path.write_text(MODELS.format(tests=str(Path(__file__).parent)))
    return path


def test_profiles_a_file_model_and_writes_json(models_file, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main([f"{models_file}:mlp", "--input-shape", "4,16", "--json", str(out), "--top-modules", "2"]) == 0
    text = capsys.readouterr().out
    assert "Profile Summary at step 1:" in text and "Top 2 modules" in text and "MLP(" in text
    report = json.loads(out.read_text())
    assert (report["flops"], report["macs"]) == mlp_counts(4)
    assert report["profile"]["children"][0]["name"] == "fc1"


def test_call_kwargs_int_input_and_output_file(models_file, tmp_path, capsys):
    out = tmp_path / "p.txt"
    data = tmp_path / "p.json"
    assert main([f"{models_file}:gpt", "--input-shape", "2,16", "--input-dtype", "int64", "--no-detailed",
                 "--output-file", str(out), "--json", str(data)]) == 0
    assert capsys.readouterr().out == ""
    assert "GPT" in out.read_text() and "Detailed Profile" not in out.read_text()
    assert json.loads(data.read_text())["flops"] == gpt_counts(2, 16)[0]
    assert main([f"{models_file}:mlp", "--input-shape", "4,16", "--call-kwargs", '{"hidden": 8}',
                 "--json", str(data)]) == 0
    assert json.loads(data.read_text())["macs"] == mlp_counts(4, hidden=8)[1]


@pytest.mark.parametrize(("argv", "message"), [
    (["nomodule", "--input-shape", "2"], "must be given as MODULE:CALLABLE"),
    (["no_such_module_xyz:f", "--input-shape", "2"], "cannot import 'no_such_module_xyz'"),
    (["{file}:missing", "--input-shape", "2"], "has no attribute 'missing'"),
    (["{file}:not_a_model", "--input-shape", "2"], "is not callable"),
    (["{file}:returns_int", "--input-shape", "2"], "returned a int, not a torch.nn.Module"),
    (["{file}:mlp", "--input-shape", "2,x"], "--input-shape must be positive integers"),
    (["{file}:mlp", "--input-shape", "2", "--call-kwargs", "[1]"], "--call-kwargs must be a JSON object"),
    (["{file}:mlp", "--input-shape", "2", "--top-modules", "0"], "need --warm-up >= 0, --top-modules >= 1"),
    (["missing.py:f", "--input-shape", "2"], "no such file: missing.py"),
])
def test_usage_errors_are_one_line_with_exit_2(argv, message, models_file, capsys):
    argv = [a.format(file=models_file) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("ds-profile: error: ")


def test_model_error_names_the_shape(models_file, capsys):
    assert main([f"{models_file}:mlp", "--input-shape", "2,7"]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: mat1 and mat2 shapes cannot be multiplied" in err and "shape (2, 7)" in err


def test_console_entry_point_runs(models_file):
    result = subprocess.run([sys.executable, "-m", "ds_profiler", f"{models_file}:mlp", "--input-shape", "4,16",
                             "--no-detailed"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "fwd flops per GPU:" in result.stdout


def _run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "ds_profiler", *argv], capture_output=True, text=True, timeout=120)


def _one_line_error(result, message):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds-profile: error: "), result.stderr
    assert message in lines[0], lines[0]
    assert "Traceback" not in result.stderr and "AssertionError" not in result.stderr


@pytest.mark.parametrize(("option", "where", "message"), [
    ("--json", "under_a_file", "cannot write there: {tmp}/a_file is not a directory"),
    ("--json", "directory", "is a directory, expected a file path"),
    ("--json", "proc", "cannot write there"),
    ("--output-file", "under_a_file", "cannot write there: {tmp}/a_file is not a directory"),
])
def test_unwritable_output_fails_before_the_run(models_file, tmp_path, option, where, message):
    """It failed after the whole run (the profile printed, then a traceback from write_text)."""
    (tmp_path / "a_file").write_text("")
    path = {"under_a_file": tmp_path / "a_file" / "p.json", "directory": tmp_path,
            "proc": "/proc/ds-profile-test.json"}[where]
    result = _run_cli(f"{models_file}:mlp", "--input-shape", "4,16", option, str(path))
    _one_line_error(result, f"{option} {path}: {message.format(tmp=tmp_path)}")
    assert result.stdout == "", "the model ran before the error"


def test_json_to_a_new_directory_is_created(models_file, tmp_path):
    out = tmp_path / "new" / "dir" / "p.json"
    result = _run_cli(f"{models_file}:mlp", "--input-shape", "4,16", "--no-detailed", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["macs"] == mlp_counts(4)[1]
    assert sorted(p.name for p in out.parent.iterdir()) == ["p.json"]  # no probe or temp file left


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_device_without_cuda_is_one_line(models_file, device):
    result = _run_cli(f"{models_file}:mlp", "--input-shape", "4,16", "--device", device)
    _one_line_error(result, f"--device {device}: CUDA is not available on this machine")
    assert result.stdout == ""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_index_beyond_the_gpus_is_one_line(models_file):
    count = torch.cuda.device_count()
    result = _run_cli(f"{models_file}:mlp", "--input-shape", "4,16", "--device", f"cuda:{count}")
    _one_line_error(result, f"--device cuda:{count}: this machine has {count} cuda device(s)")
    result = _run_cli(f"{models_file}:mlp", "--input-shape", "4,16", "--device", "cuda", "--no-detailed")
    assert result.returncode == 0, result.stderr
