"""The launcher's own options: values that start with '-', and what is left to the program."""

from __future__ import annotations

import shlex
import sys

import pytest

VALUES = ["-mca btl_tcp_if_include eth1", "-H node1,node2", "-x NCCL_DEBUG=INFO", "-e x", "-i y", "--oversubscribe"]


@pytest.mark.parametrize("form", ["separate", "equals"])
@pytest.mark.parametrize("value", VALUES)
def test_launcher_args_may_start_with_a_dash(tmp_path, run_launcher, value, form):
    """DeepSpeed's ``--launcher_args '-mca btl_tcp_if_include eth1'``: argparse read ``-mca`` as our
    ``-m`` with the value ``ca`` (and ``-H``, ``-e``, ``-i`` alike) and said "expected one argument"."""
    script = tmp_path / "train.py"
    script.write_text("")
    option = ["--launcher_args", value] if form == "separate" else [f"--launcher_args={value}"]
    result = run_launcher("--force_multi", "--launcher", "openmpi", *option, "--dry_run", str(script), "a")
    assert result.returncode == 0, result.stderr
    mpirun = next(line for line in result.stdout.splitlines() if line.strip().startswith("mpirun "))
    assert f" --map-by slot {value} " in mpirun, mpirun
    assert " -m " not in mpirun.split(value)[0]  # not taken as --module


def test_deepspeeds_documented_launcher_args_with_a_hostfile(tmp_path, run_launcher):
    """The issue's command line, word for word: ``--hostfile H --launcher openmpi --launcher_args
    '-mca btl_tcp_if_include eth1' train.py``; the user's interface replaces DeepSpeed's eth0 default."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    script = tmp_path / "train.py"
    script.write_text("")
    result = run_launcher("--hostfile", str(hostfile), "--launcher", "openmpi", "--launcher_args",
                          "-mca btl_tcp_if_include eth1", "--dry_run", str(script), "--deepspeed_config", "c.json")
    assert result.returncode == 0, result.stderr
    mpirun = next(shlex.split(line) for line in result.stdout.splitlines() if line.strip().startswith("mpirun "))
    shim = mpirun.index(sys.executable)
    assert mpirun[:shim] == ["mpirun", "-n", "4", "-hostfile", "{hostfile}", "--mca", "btl", "^openib",
                             "--map-by", "slot", "-mca", "btl_tcp_if_include", "eth1", "-x", "UCX_TLS=tcp"]
    assert f"{script} --local_rank=0 --deepspeed_config c.json" in result.stdout


@pytest.mark.parametrize("name", ["OpenMPI", "MVAPICH", "PDSH", "Slurm"])
def test_launcher_name_in_any_case(tmp_path, run_launcher, name):
    """DeepSpeed lower-cases --launcher (its help lists 'PDSH, OpenMPI, MVAPICH, SLURM, MPICH')."""
    script = tmp_path / "train.py"
    script.write_text("")
    result = run_launcher("--force_multi", "--launcher", name, "--dry_run", str(script))
    assert result.returncode == 0, result.stderr
    assert {"openmpi": "[mpirun (openmpi)]", "mvapich": "[mpirun (mvapich)]", "pdsh": "[pdsh]",
            "slurm": "[srun]"}[name.lower()] in result.stdout


@pytest.mark.parametrize("short, long", [("-H", "hostfile"), ("-i", "include"), ("-e", "exclude")])
def test_short_options_take_their_value(tmp_path, run_launcher, short, long):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    script = tmp_path / "train.py"
    script.write_text("")
    args = ["-H", str(hostfile)] + ([short, "localhost:0"] if short != "-H" else [])
    result = run_launcher(*args, "--dry_run", str(script))
    assert result.returncode == 0, result.stderr
    ranks = [line for line in result.stdout.splitlines() if line.strip().startswith("rank ")]
    assert len(ranks) == {"hostfile": 2, "include": 1, "exclude": 1}[long], result.stdout


def test_program_arguments_are_left_alone(tmp_path, run_launcher):
    script = tmp_path / "train.py"
    script.write_text("")
    program_args = ["--save_pid", "--num_gpu", "-mca", "x", "--launcher_args", "-H"]
    result = run_launcher("--save_pid", "--dry_run", str(script), *program_args)
    assert result.returncode == 0, result.stderr
    assert f"{script} --local_rank=0 {' '.join(program_args)}" in result.stdout
