"""DeepSpeed runner flags a launch command may carry: ``--no_ssh``, ``--no_ssh_check``, ``--venv_script``,
``--log_level`` and ``-q/--quiet`` are accepted with DeepSpeed's meaning (they were refused as unknown)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ds_launch import LaunchError
from ds_launch._deepspeed_args import parse_deepspeed_args
from ds_launch.cli import make_plan
from ds_launch.runners import build_commands
from ds_launch.spec import NodeSpec, Program


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('ran')\n")
    return str(path)


@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("a slots=2\nb slots=2\n")
    return str(path)


def test_no_ssh_with_a_node_rank_starts_that_node_only(script, hostfile):
    _args, spec, launcher = make_plan(["--hostfile", hostfile, "--no_ssh", "--node_rank", "1", script])
    assert launcher is None and spec.node_rank == 1 and spec.master_addr == "a"  # this node's ranks, no ssh
    assert [p.rank for p in spec.plan()] == [2, 3]


def test_no_ssh_without_a_node_rank_is_refused_as_deepspeed_asserts(script, hostfile):
    with pytest.raises(LaunchError, match=r"--no_ssh starts only this node's ranks: give its --node_rank"):
        make_plan(["--hostfile", hostfile, "--no_ssh", script])


def test_no_ssh_check_is_accepted(script, hostfile):
    args, _spec, launcher = make_plan(["--hostfile", hostfile, "--no_ssh_check", script])
    assert args.no_ssh_check and launcher == "ssh"


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_venv_script_is_sourced_before_each_node_agent(tmp_path, launcher):
    spec = NodeSpec({"a": [0], "b": [0]}, 0, "a", 29500, Program("t.py"))
    commands = build_commands(launcher, spec, environ={"PATH": "/bin"}, cwd=str(tmp_path),
                              venv_script="/opt/venv/bin/activate")
    for command in commands:
        assert command.argv[-1].startswith(". /opt/venv/bin/activate && ")
    plain = build_commands(launcher, spec, environ={"PATH": "/bin"}, cwd=str(tmp_path))
    assert not plain[0].argv[-1].startswith(".")


def test_a_venv_script_that_fails_stops_the_node_before_any_rank(tmp_path):
    """What a remote shell runs: a script that cannot be sourced ends the command, nothing else starts."""
    spec = NodeSpec({"a": [0], "b": [0]}, 0, "a", 29500, Program("t.py"))
    (command,) = build_commands("pdsh", spec, environ={"PATH": "/bin"}, cwd=str(tmp_path),
                                venv_script=str(tmp_path / "missing_activate"))
    source, _, agent = command.argv[-1].partition(" && ")
    assert source == f". {tmp_path}/missing_activate" and agent.startswith(sys.executable)
    result = subprocess.run(["sh", "-c", f"{source} && touch {tmp_path}/STARTED"], capture_output=True)
    assert result.returncode != 0 and not (tmp_path / "STARTED").exists()
    (tmp_path / "activate").write_text("export FROM_VENV=1\n")
    result = subprocess.run(["sh", "-c", f". {tmp_path}/activate && echo $FROM_VENV"], capture_output=True, text=True)
    assert result.stdout.strip() == "1"


def test_a_venv_script_path_a_shell_would_read_as_code_is_refused(script, hostfile):
    with pytest.raises(LaunchError, match=r"--venv_script '/tmp/x; rm -rf y': the path may hold only"):
        make_plan(["--hostfile", hostfile, "--venv_script", "/tmp/x; rm -rf y", script])


def test_log_level_and_quiet_parse_as_deepspeeds_runner(script):
    ns = parse_deepspeed_args(["--log_level", "warning", "-q", "--no_ssh_check", script])
    assert (ns.log_level, ns.quiet, ns.no_ssh, ns.no_ssh_check, ns.venv_script) == ("warning", True, False, True, None)
    with pytest.raises(SystemExit):
        parse_deepspeed_args(["--log_level", "loud", script])


@pytest.mark.parametrize("flags, shown", [([], True), (["--log_level", "warning"], True),
                                          (["--log_level", "error"], False), (["-q"], False)])
def test_quiet_and_log_level_silence_ds_launchs_warnings(script, flags, shown, port):
    result = subprocess.run([sys.executable, "-m", "ds_launch", *flags, "--launcher", "pdsh", "--master_port",
                             str(port), script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert result.returncode == 0, result.stderr
    assert ("--launcher ignored: this is a single-node launch" in result.stderr) == shown, result.stderr
