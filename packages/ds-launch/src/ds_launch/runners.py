"""Multi-node runners: the commands that start a launch on several machines.

``ssh`` and ``pdsh`` start a node agent (``python -m ds_launch.node``) on every node through a
remote shell; ``openmpi``, ``mpich`` and ``slurm`` start every rank themselves, and each rank
passes through ``python -m ds_launch.rank_env``, which turns the MPI/SLURM variables into the
ones a ds-launch rank sees. Every string handed to a remote shell is built with `shlex.quote`,
so no hostname, argument or environment value can inject shell code.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass, field

from .resources import LaunchError
from .spec import NodeSpec, encode_world

LAUNCHERS = ("ssh", "pdsh", "openmpi", "mpich", "slurm")
# Variables forwarded to remote nodes, as DeepSpeed does (DS_ for our own settings, e.g. DS_OPS_CACHE).
EXPORT_PREFIXES = ("NCCL_", "PYTHON", "MV2_", "UCX_", "DS_")
EXPORT_NAMES = ("PATH",)
ENV_FILE_NAME = ".deepspeed_env"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass
class LaunchCommand:
    """One local process that starts (part of) the launch on other machines."""

    label: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    files: dict[str, str] = field(default_factory=dict)  # path -> content, written before start
    watch_stdin: bool = False  # keep a pipe on its stdin: closing it stops the remote node


def read_env_file(path: str) -> dict[str, str]:
    """``NAME=value`` lines (blank lines and ``#`` comments allowed); the value is the rest of the line."""
    env: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise LaunchError(f"cannot read environment file {path}: {e.strerror or e}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not _ENV_NAME.match(name):
            raise LaunchError(f"environment file {path} line {number}: expected NAME=value, got {line!r}")
        env[name] = value
    return env


def forwarded_env(environ: dict[str, str] | None = None, cwd: str | None = None,
                  home: str | None = None) -> dict[str, str]:
    """What remote ranks get from here: PATH, the NCCL_/PYTHON*/MV2_/UCX_/DS_ variables, then
    the ``.deepspeed_env`` files of the home and the working directory (the latter wins).
    ``DS_ENV_FILE`` names another file."""
    environ = dict(os.environ if environ is None else environ)
    env = {k: v for k, v in environ.items() if k in EXPORT_NAMES or k.startswith(EXPORT_PREFIXES)}
    name = environ.get("DS_ENV_FILE", ENV_FILE_NAME)
    candidates = [name] if os.path.isabs(name) else [
        os.path.join(home or os.path.expanduser("~"), name), os.path.join(cwd or os.getcwd(), name)]
    for path in dict.fromkeys(candidates):
        if os.path.isfile(path):
            env.update(read_env_file(path))
    return env


def remote_shell_command(argv: list[str], env: dict[str, str], cwd: str) -> str:
    """One POSIX-shell line: enter ``cwd``, export ``env``, exec ``argv``; every piece quoted."""
    for name in env:
        if not _ENV_NAME.match(name):
            raise LaunchError(f"cannot forward environment variable {name!r}: not a valid shell name")
    parts = [f"cd {shlex.quote(cwd)}"]
    if env:
        parts.append("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))
    parts.append("exec " + shlex.join(argv))
    return " && ".join(parts)


def _uniform_slots(spec: NodeSpec, launcher: str) -> int:
    counts = {len(slots) for slots in spec.world.values()}
    if len(counts) != 1:
        layout = ", ".join(f"{h}={len(s)}" for h, s in spec.world.items())
        raise LaunchError(f"the {launcher} launcher needs the same number of processes on every node, got {layout}")
    return counts.pop()


def _whole_hosts(spec: NodeSpec, launcher: str) -> None:
    for host, slots in spec.world.items():
        if slots != list(range(len(slots))):
            raise LaunchError(
                f"the {launcher} launcher cannot pick slots ({host} would use slots {slots}); "
                "choose hosts with --include host1@host2 or counts with --num_gpus"
            )


def shim_argv(spec: NodeSpec) -> list[str]:
    """Each MPI/SLURM rank runs this; it sets RANK/LOCAL_RANK/... and execs the program."""
    return [sys.executable, "-u", "-m", "ds_launch.rank_env", "--world_info", encode_world(spec.world),
            "--master_addr", spec.master_addr, "--master_port", str(spec.master_port),
            *spec.program.flags()]


def build_commands(launcher: str, spec: NodeSpec, launcher_args: str = "", ssh_port: int | None = None,
                   environ: dict[str, str] | None = None, cwd: str | None = None) -> list[LaunchCommand]:
    """The local processes that start ``spec``'s world with ``launcher``."""
    cwd = os.path.abspath(cwd or os.getcwd())
    extra = shlex.split(launcher_args)
    env = forwarded_env(environ, cwd)
    hosts = spec.hosts
    if launcher == "ssh":
        port = ["-p", str(ssh_port)] if ssh_port else []
        return [
            LaunchCommand(
                f"node {i} ({host})",
                ["ssh", "-o", "BatchMode=yes", *port, *extra, "--", host,
                 remote_shell_command(spec.node_argv(i, watch_stdin=True), env, cwd)],
                watch_stdin=True,
            )
            for i, host in enumerate(hosts)
        ]
    if launcher == "pdsh":
        # pdsh replaces %n with each host's position in the -w list: the node rank.
        pdsh_env = {} if "PDSH_RCMD_TYPE" in (environ or os.environ) else {"PDSH_RCMD_TYPE": "ssh"}
        return [LaunchCommand("pdsh", ["pdsh", "-S", "-f", "1024", "-w", ",".join(hosts), *extra,
                                       remote_shell_command(spec.node_argv("%n"), env, cwd)], pdsh_env)]
    if spec.bind_cores_to_rank or spec.log_dir:
        raise LaunchError(f"--bind_cores_to_rank and --enable_each_rank_log need the ssh or pdsh launcher, not {launcher}")
    total = str(spec.world_size)
    if launcher == "openmpi":
        _whole_hosts(spec, launcher)
        hostfile = os.path.join(tempfile.gettempdir(), f"ds-launch-hostfile-{os.getpid()}")
        content = "".join(f"{h} slots={len(s)}\n" for h, s in spec.world.items())
        exports = [a for name in env for a in ("-x", name)]
        return [LaunchCommand("mpirun (openmpi)", ["mpirun", "-n", total, "-hostfile", hostfile, "--map-by", "slot",
                                                   *exports, *extra, *shim_argv(spec)], env, {hostfile: content})]
    if launcher == "mpich":
        per_node = _uniform_slots(spec, launcher)
        _whole_hosts(spec, launcher)
        exports = [a for name, value in env.items() for a in ("-genv", name, value)]
        return [LaunchCommand("mpirun (mpich)", ["mpirun", "-n", total, "-ppn", str(per_node), "-hosts", ",".join(hosts),
                                                 *exports, *extra, *shim_argv(spec)])]
    if launcher == "slurm":
        per_node = _uniform_slots(spec, launcher)
        _whole_hosts(spec, launcher)
        return [LaunchCommand("srun", ["srun", "-n", total, "--nodes", str(len(hosts)), "--ntasks-per-node", str(per_node),
                                       "--nodelist", ",".join(hosts), "--export", "ALL", *extra, *shim_argv(spec)], env)]
    raise LaunchError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
