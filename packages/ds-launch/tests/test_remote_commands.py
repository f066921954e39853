"""Commands built for remote shells and for MPI/SLURM: hostile values stay data, never code."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from ds_launch import LaunchError
from ds_launch.rank_env import resolve
from ds_launch.runners import (
    build_commands,
    check_backend,
    forwarded_env,
    read_env_file,
    remote_command,
)
from ds_launch.spec import NodeSpec, Program

HOSTILE = [
    "$(touch {sentinel})",
    "`touch {sentinel}`",
    "; touch {sentinel}",
    "' ; touch {sentinel} ; '",
    '" ; touch {sentinel} ; "',
    "\n touch {sentinel}\n",
    "&& touch {sentinel} #",
    "| touch {sentinel}",
    "> {sentinel}",
    "%n %h ${{HOME}} \\ \\' *",
]


def _hostile(sentinel) -> list[str]:
    return [h.format(sentinel=sentinel) for h in HOSTILE]


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_hostile_arguments_env_and_cwd_survive_a_real_shell_unchanged(tmp_path, dump, launcher, port):
    """Build the remote command, run it through sh -c as the remote side would: the rank must
    receive every hostile string byte for byte and no injected command may run."""
    script, out, read = dump
    sentinel = tmp_path / "INJECTED"
    values = _hostile(sentinel)
    cwd = tmp_path / "dir with 'quotes' and $(touch x) spaces"
    cwd.mkdir()
    environ = {"PATH": os.environ["PATH"], "NCCL_HOSTILE": values[0], "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
               "UCX_HOSTILE": values[3], "DS_ENV_FILE": str(tmp_path / "env_file")}
    (tmp_path / "env_file").write_text("".join(f"HOSTILE_{i}={v}\n" for i, v in enumerate(values) if "\n" not in v)
                                       + f"DUMP_DIR={out}\n")
    spec = NodeSpec({"localhost": [0]}, 0, "127.0.0.1", port, Program(str(script), tuple(values)))
    command = build_commands(launcher, spec, environ=environ, cwd=str(cwd))[0]
    remote = command.argv[-1]
    if launcher == "pdsh":
        assert "--node_rank %n" in remote and remote.count("%") == 1
        remote = remote.replace("%n", "0")  # what pdsh does for the first host
    errors = tmp_path / "stderr"
    with open(errors, "wb") as err:
        shell = subprocess.Popen(["sh", "-c", remote], stdin=subprocess.PIPE, stderr=err)
        shell.wait(timeout=60)  # stdin stays open meanwhile: the node agent takes EOF as "stop"
        shell.stdin.close()
    assert shell.returncode == 0, errors.read_text()
    assert not sentinel.exists(), "a hostile value ran as shell code"
    record = read(0)
    assert record["argv"] == ["--local_rank=0", *values]
    assert record["cwd"] == str(cwd)
    assert record["env"]["NCCL_HOSTILE"] == values[0]
    assert record["env"]["UCX_HOSTILE"] == values[3]
    for i, v in enumerate(values):
        if "\n" not in v:
            assert record["env"][f"HOSTILE_{i}"] == v


def test_remote_command_lines_are_shell_neutral(tmp_path):
    """No character any shell (sh, bash, zsh, fish, csh) treats specially reaches a remote shell."""
    values = _hostile(tmp_path / "x")
    spec = NodeSpec({"a": [0], "b": [0]}, 0, "a", 29500, Program("train.py", tuple(values)))
    environ = {"PATH": "/bin", "NCCL_X": values[1]}
    for launcher in ("ssh", "pdsh"):
        for command in build_commands(launcher, spec, environ=environ, cwd=str(tmp_path)):
            assert re.fullmatch(r"[A-Za-z0-9_./=%+ -]+", command.argv[-1]), command.argv[-1]
    with pytest.raises(LaunchError, match="a remote command may hold only"):
        remote_command(["/opt/my python/bin/python", "-u"])
    with pytest.raises(LaunchError, match="--launcher_args"):
        build_commands("ssh", spec, launcher_args="'unbalanced")


def test_ssh_command_shape():
    spec = NodeSpec({"node-a": [0, 1], "node-b": [0, 1]}, 0, "node-a", 29500, Program("train.py", ("--x",)))
    commands = build_commands("ssh", spec, launcher_args="-F '/my config'", ssh_port=2222, environ={"PATH": "/bin"},
                              cwd="/work")
    assert [c.label for c in commands] == ["node 0 (node-a)", "node 1 (node-b)"]
    for i, c in enumerate(commands):
        assert c.argv[:8] == ["ssh", "-o", "BatchMode=yes", "-p", "2222", "-F", "/my config", "--"]
        assert c.argv[8] == ["node-a", "node-b"][i]
        assert c.stop_with_eof
        remote = c.argv[9].split()
        assert remote[:4] == [sys.executable, "-u", "-m", "ds_launch.node"]
        assert remote[remote.index("--node_rank") + 1] == str(i)
        assert remote[-1] == "--watch_stdin"
        decoded = NodeSpec.decode(remote[remote.index("--spec") + 1], i)
        assert decoded.cwd == "/work" and decoded.env == {"PATH": "/bin", "PYTHONPATH": "/work"}
        assert decoded.program == spec.program and decoded.world == spec.world


def test_mpi_and_slurm_command_shapes(tmp_path):
    spec = NodeSpec({"a": [0, 1], "b": [0, 1]}, 0, "a", 29500, Program("train.py"))
    env = {"PATH": "/bin", "NCCL_DEBUG": "INFO", "HOME": "/root"}
    (openmpi,) = build_commands("openmpi", spec, environ=env, cwd=str(tmp_path))
    assert openmpi.argv[:5] == ["mpirun", "-n", "4", "-hostfile", "{hostfile}"]
    assert openmpi.files == {"{hostfile}": "a slots=2\nb slots=2\n"}
    (mpich,) = build_commands("mpich", spec, environ=env, cwd=str(tmp_path))
    assert mpich.argv[:7] == ["mpirun", "-n", "4", "-ppn", "2", "-hosts", "a,b"]
    (srun,) = build_commands("slurm", spec, environ=env, cwd=str(tmp_path))
    assert srun.argv[:9] == ["srun", "-n", "4", "--nodes", "2", "--ntasks-per-node", "2", "--nodelist", "a,b"]
    for command in (openmpi, mpich, srun):
        shim = command.argv[-6:]
        assert shim[:5] == [sys.executable, "-u", "-m", "ds_launch.rank_env", "--spec"]
        decoded = NodeSpec.decode(shim[5])
        assert decoded.env == {"PATH": "/bin", "NCCL_DEBUG": "INFO", "PYTHONPATH": str(tmp_path)}
        assert decoded.cwd == str(tmp_path)


def _before_shim(command) -> list[str]:
    return command.argv[:command.argv.index(sys.executable)]


OPENMPI_HEAD = ["mpirun", "-n", "4", "-hostfile", "{hostfile}"]
MCA_DEFAULTS = ["--mca", "btl", "^openib", "--mca", "btl_tcp_if_include", "eth0"]


@pytest.mark.parametrize("launcher_args, environ, expected", [
    # DeepSpeed's OpenMPIRunner: --mca btl ^openib, --mca btl_tcp_if_include eth0, the user's
    # arguments after them, then -x UCX_TLS=tcp (ds-launch adds --map-by slot for its rank shim)
    ("", {}, [*MCA_DEFAULTS, "--map-by", "slot", "-x", "UCX_TLS=tcp"]),
    ("--oversubscribe", {}, [*MCA_DEFAULTS, "--map-by", "slot", "--oversubscribe", "-x", "UCX_TLS=tcp"]),
    # a user's btl_tcp_if_include replaces the default (as in DeepSpeed), with -mca or --mca
    ("-mca btl_tcp_if_include eth1", {},
     ["--mca", "btl", "^openib", "--map-by", "slot", "-mca", "btl_tcp_if_include", "eth1", "-x", "UCX_TLS=tcp"]),
    ("--mca btl_tcp_if_include ib0", {},
     ["--mca", "btl", "^openib", "--map-by", "slot", "--mca", "btl_tcp_if_include", "ib0", "-x", "UCX_TLS=tcp"]),
    # beyond DeepSpeed: Open MPI refuses include + exclude, and joins two values of one name
    ("--mca btl_tcp_if_exclude lo,docker0", {},
     ["--mca", "btl", "^openib", "--map-by", "slot", "--mca", "btl_tcp_if_exclude", "lo,docker0", "-x", "UCX_TLS=tcp"]),
    ("--mca btl tcp,self", {},
     ["--mca", "btl_tcp_if_include", "eth0", "--map-by", "slot", "--mca", "btl", "tcp,self", "-x", "UCX_TLS=tcp"]),
    # an OMPI_MCA_ variable is a setting too (a command-line default would override it)
    ("", {"OMPI_MCA_btl_tcp_if_include": "ib0"}, ["--mca", "btl", "^openib", "--map-by", "slot", "-x", "UCX_TLS=tcp"]),
    # the user's placement replaces --map-by slot; the user's UCX_TLS replaces the default
    ("--map-by ppr:2:node", {}, [*MCA_DEFAULTS, "--map-by", "ppr:2:node", "-x", "UCX_TLS=tcp"]),
    ("", {"UCX_TLS": "rc,sm"}, [*MCA_DEFAULTS, "--map-by", "slot"]),
])
def test_openmpi_command_has_deepspeeds_defaults(tmp_path, launcher_args, environ, expected):
    spec = NodeSpec({"a": [0, 1], "b": [0, 1]}, 0, "a", 29500, Program("train.py", ("--lr", "1")))
    (command,) = build_commands("openmpi", spec, launcher_args, environ={"PATH": "/bin", **environ}, cwd=str(tmp_path))
    assert _before_shim(command) == OPENMPI_HEAD + expected
    decoded = NodeSpec.decode(command.argv[-1])
    assert decoded.env.get("UCX_TLS") == environ.get("UCX_TLS")  # the user's value travels with the launch
    assert decoded.program.args == ("--lr", "1")


def test_mvapich_command_is_deepspeeds(tmp_path):
    """DeepSpeed's MVAPICHRunner: mpirun -np N -ppn P --hostfile H <launcher_args> -env MV2_...=... ."""
    spec = NodeSpec({"a": [0, 1, 2], "b": [0, 1, 2]}, 0, "a", 29500, Program("train.py"))
    environ = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2", "MV2_ENABLE_AFFINITY": "1"}
    (command,) = build_commands("mvapich", spec, "-verbose", environ=environ, cwd=str(tmp_path))
    assert command.files == {"{hostfile}": "a\nb\n"}  # host names only, one per line
    assert _before_shim(command) == [
        "mpirun", "-np", "6", "-ppn", "3", "--hostfile", "{hostfile}", "-verbose",
        "-env", "MV2_SMP_USE_CMA=0", "-env", "MV2_DEBUG_SHOW_BACKTRACE=1", "-env", "MV2_USE_CUDA=1",
        "-env", "MV2_SUPPORT_DL=1", "-env", "MV2_INTER_ALLGATHER_TUNING=5", "-env", "MV2_CUDA_USE_NAIVE=0"]
    assert NodeSpec.decode(command.argv[-1]).env["MV2_ENABLE_AFFINITY"] == "1"  # the user's, not the default 0
    (cpu,) = build_commands("mvapich", spec, environ={"PATH": "/bin", "CUDA_VISIBLE_DEVICES": ""}, cwd=str(tmp_path))
    assert "MV2_USE_CUDA=1" not in cpu.argv and "MV2_ENABLE_AFFINITY=0" in cpu.argv
    uneven = NodeSpec({"a": [0, 1], "b": [0]}, 0, "a", 29500, Program("train.py"))
    with pytest.raises(ValueError, match="the mvapich launcher needs the same number of processes on every node"):
        build_commands("mvapich", uneven, environ={})
    picked = NodeSpec({"a": [1], "b": [1]}, 0, "a", 29500, Program("train.py"))
    with pytest.raises(ValueError, match="the mvapich launcher cannot pick slots"):
        build_commands("mvapich", picked, environ={})


def test_multi_node_ranks_get_the_launch_directory_on_pythonpath_and_mlflow_variables(tmp_path):
    """DeepSpeed's runner puts the working directory first on PYTHONPATH and exports MLFLOW*."""
    spec = NodeSpec({"a": [0], "b": [0]}, 0, "a", 29500, Program("train.py"))
    environ = {"PATH": "/bin", "PYTHONPATH": "/lib/x", "MLFLOW_TRACKING_URI": "http://m:5000", "OTHER": "no"}
    for launcher in ("ssh", "pdsh", "openmpi", "mpich", "mvapich", "slurm"):
        command = build_commands(launcher, spec, environ=environ, cwd=str(tmp_path))[0]
        payload = command.argv[-1].split()[command.argv[-1].split().index("--spec") + 1] \
            if launcher in ("ssh", "pdsh") else command.argv[-1]
        env = NodeSpec.decode(payload).env
        assert env["PYTHONPATH"] == f"{tmp_path}:/lib/x", launcher
        assert env["MLFLOW_TRACKING_URI"] == "http://m:5000" and "OTHER" not in env


def test_missing_backend_is_named_before_anything_starts(tmp_path):
    spec = NodeSpec({"a": [0], "b": [0]}, 0, "a", 29500, Program("train.py"))
    empty = {"PATH": str(tmp_path)}
    for launcher, program in [("openmpi", "Open MPI's mpirun ('mpirun')"), ("mvapich", "MVAPICH's mpirun ('mpirun')"),
                              ("slurm", "SLURM's srun ('srun')"), ("pdsh", "pdsh ('pdsh')")]:
        (command,) = build_commands(launcher, spec, environ=empty, cwd=str(tmp_path))
        with pytest.raises(ValueError, match=rf"--launcher {launcher} needs {re.escape(program)} on PATH; not found"):
            check_backend(launcher, command, empty)
    # MVAPICH as DeepSpeed checks it: its mpiname must exist and say MVAPICH
    (command,) = build_commands("mvapich", spec, environ=empty, cwd=str(tmp_path))
    (tmp_path / "mpirun").write_text("#!/bin/sh\n")
    (tmp_path / "mpirun").chmod(0o755)
    with pytest.raises(ValueError, match="needs MVAPICH's 'mpiname' on PATH"):
        check_backend("mvapich", command, empty)
    (tmp_path / "mpiname").write_text("#!/bin/sh\necho 'Open MPI 4.1.5'\n")
    (tmp_path / "mpiname").chmod(0o755)
    with pytest.raises(ValueError, match=r"mpiname says 'Open MPI 4\.1\.5', not MVAPICH"):
        check_backend("mvapich", command, empty)
    (tmp_path / "mpiname").write_text("#!/bin/sh\necho 'MVAPICH2 2.3.7 ch3:mrail'\n")
    check_backend("mvapich", command, empty)


def test_env_file_errors_name_the_line(tmp_path):
    path = tmp_path / ".deepspeed_env"
    path.write_text("A=1\n# comment\n\nB=x=y\nnot valid\n")
    with pytest.raises(LaunchError, match=r"\.deepspeed_env line 5: expected NAME=value, got 'not valid'"):
        read_env_file(str(path))
    path.write_text("A=1\nB=x=y\n")
    assert read_env_file(str(path)) == {"A": "1", "B": "x=y"}


def test_forwarded_env_takes_prefixes_then_home_then_cwd_files(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("X=home\nY=home\n")
    (cwd / ".deepspeed_env").write_text("Y=cwd\n")
    environ = {"PATH": "/bin", "NCCL_A": "1", "PYTHONPATH": "/p", "MV2_B": "2", "UCX_C": "3", "DS_D": "4",
               "MLFLOW_E": "5", "SECRET_TOKEN": "no", "HOME": "/root"}
    env = forwarded_env(environ, cwd=str(cwd), home=str(home))
    assert env == {"PATH": "/bin", "NCCL_A": "1", "PYTHONPATH": "/p", "MV2_B": "2", "UCX_C": "3", "DS_D": "4",
                   "MLFLOW_E": "5", "X": "home", "Y": "cwd"}


WORLD = NodeSpec({"a": [0, 1], "b": [0, 1]}, 0, "a", 29500, Program("train.py"))


@pytest.mark.parametrize("env, rank, local_rank, node", [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, 3, 1, 1),
    ({"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "0"}, 2, 0, 1),
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"}, 1, 1, 0),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}, 2, 0, 1),
])
def test_rank_shim_maps_launcher_variables(env, rank, local_rank, node):
    plan = resolve(WORLD, env)
    assert (plan.rank, plan.local_rank, plan.node_rank, plan.host) == (rank, local_rank, node, "ab"[node])
    assert plan.env["RANK"] == str(rank) and plan.env["CROSS_RANK"] == str(node)
    assert plan.env["WORLD_SIZE"] == "4" and plan.env["LOCAL_WORLD_SIZE"] == "2"


@pytest.mark.parametrize("env, message", [
    ({}, "no launcher told this process its rank"),
    ({"PMI_RANK": "0", "PMI_SIZE": "3"}, "the launcher started 3 processes, but the world has 4"),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}, "rank 1 is local rank 0 to the launcher but 1"),
    ({"PMI_RANK": "x", "PMI_SIZE": "4"}, "are not integers"),
])
def test_rank_shim_errors(env, message):
    with pytest.raises(LaunchError, match=message):
        resolve(WORLD, env)


def test_rank_shim_execs_the_program_with_the_rank_environment(tmp_path, dump):
    script, out, read = dump
    spec = NodeSpec({"a": [0], "b": [0]}, 0, "a", 1234, Program(str(script), ("arg",)), cwd=str(tmp_path),
                    env={"DUMP_DIR": str(out), "NCCL_FROM_SPEC": "yes"})
    env = {**os.environ, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    subprocess.run([sys.executable, "-m", "ds_launch.rank_env", "--spec", spec.encode()], env=env, check=True,
                   timeout=60)
    record = read(1)
    assert record["argv"] == ["--local_rank=0", "arg"]
    assert record["cwd"] == str(tmp_path)
    assert record["env"]["CROSS_RANK"] == "1" and record["env"]["MASTER_ADDR"] == "a"
    assert record["env"]["MASTER_PORT"] == "1234" and record["env"]["NCCL_FROM_SPEC"] == "yes"


def test_spec_round_trips_and_rejects_garbage():
    spec = NodeSpec({"a": [0, 2], "b": [1]}, 0, "a", 29500, Program("m", ("x", "y"), "module", False), True, "0-3",
                    "/logs", 2.5, "/work", {"A": "1"})
    assert NodeSpec.decode(spec.encode(), 1) == dataclasses.replace(spec, node_rank=1)
    with pytest.raises(LaunchError, match="--spec is not a launch description"):
        NodeSpec.decode("bm90IGpzb24=")
    with pytest.raises(LaunchError, match=r"--node_rank 2 is outside 0\.\.1"):
        NodeSpec.decode(spec.encode(), 2)
