"""Multi-node runners: the commands that start a launch on several machines.

``ssh`` and ``pdsh`` start a node agent (``python -m ds_launch.node``) on every node through a
remote shell; ``openmpi``, ``mpich`` and ``slurm`` start every rank themselves, and each rank
passes through ``python -m ds_launch.rank_env``, which turns the MPI/SLURM variables into the
ones a ds-launch rank sees. Either way the launch (working directory, forwarded environment,
program and arguments) travels as one base64 argument: a remote command line holds only
letters, digits and ``_./=%+-``, so no remote shell of any kind can read user data as code.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from dataclasses import dataclass, field

from .resources import LaunchError, read_lines
from .spec import NodeSpec

LAUNCHERS = ("ssh", "pdsh", "openmpi", "mpich", "slurm")
# Variables forwarded to remote nodes, as DeepSpeed does (DS_ for our own settings, e.g. DS_OPS_CACHE).
EXPORT_PREFIXES = ("NCCL_", "PYTHON", "MV2_", "UCX_", "DS_")
EXPORT_NAMES = ("PATH",)
ENV_FILE_NAME = ".deepspeed_env"
HOSTFILE_PLACEHOLDER = "{hostfile}"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass
class LaunchCommand:
    """One local process that starts (part of) the launch on other machines."""

    label: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    # Temporary files the command needs: placeholder in argv -> content. The launcher writes each
    # to a fresh private temporary file, puts its path in place of the placeholder, removes it after.
    files: dict[str, str] = field(default_factory=dict)
    stop_with_eof: bool = False  # an ssh client: closing its stdin stops the remote node agent
    failure_line: str | None = None  # a stderr line (regex, group "code") that reports a failed node


def read_env_file(path: str) -> dict[str, str]:
    """``NAME=value`` lines (blank lines and ``#`` comments allowed); the value is the rest of the line."""
    env: dict[str, str] = {}
    for number, line in enumerate(read_lines(path, "environment file"), start=1):
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


_SHELL_NEUTRAL = re.compile(r"[A-Za-z0-9_./=%+-]+\Z")


def remote_command(argv: list[str]) -> str:
    """The command line for a remote shell; refuses anything a shell could read as more than text."""
    for word in argv:
        if not _SHELL_NEUTRAL.match(word):
            raise LaunchError(f"cannot start {word!r} on a remote node: a remote command may hold only letters, "
                              "digits and _./=%+- (is the Python interpreter's path unusual?)")
    return " ".join(argv)


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


def build_commands(launcher: str, spec: NodeSpec, launcher_args: str = "", ssh_port: int | None = None,
                   environ: dict[str, str] | None = None, cwd: str | None = None) -> list[LaunchCommand]:
    """The local processes that start ``spec``'s world with ``launcher``."""
    try:
        extra = shlex.split(launcher_args)
    except ValueError as e:
        raise LaunchError(f"--launcher_args {launcher_args!r}: {e}") from None
    cwd = os.path.abspath(cwd or os.getcwd())
    spec = dataclasses.replace(spec, cwd=cwd, env=forwarded_env(environ, cwd))
    payload = spec.encode()
    hosts = spec.hosts

    def agent(node_rank: str) -> str:
        return remote_command([sys.executable, "-u", "-m", "ds_launch.node", "--spec", payload,
                               "--node_rank", node_rank, "--watch_stdin"])

    if launcher == "ssh":
        port = ["-p", str(ssh_port)] if ssh_port else []
        return [LaunchCommand(f"node {i} ({host})", ["ssh", "-o", "BatchMode=yes", *port, *extra, "--", host,
                                                     agent(str(i))], stop_with_eof=True)
                for i, host in enumerate(hosts)]
    if launcher == "pdsh":
        # pdsh replaces %n with each host's position in the -w list: the node rank. It keeps each
        # remote command's stdin open while it lives, so the agents stop when pdsh is stopped. It
        # waits for every node before it exits, so its report of a failed node is watched for.
        pdsh_env = {} if "PDSH_RCMD_TYPE" in (os.environ if environ is None else environ) else {"PDSH_RCMD_TYPE": "ssh"}
        return [LaunchCommand("pdsh", ["pdsh", "-S", "-b", "-f", "1024", "-w", ",".join(hosts), *extra, agent("%n")],
                              pdsh_env, failure_line=r"^pdsh@\S+: \S+: \S+ exited with exit code (?P<code>\d+)")]
    if spec.bind_cores_to_rank or spec.log_dir:
        raise LaunchError(f"--bind_cores_to_rank and --enable_each_rank_log need the ssh or pdsh launcher, not {launcher}")
    shim = [sys.executable, "-u", "-m", "ds_launch.rank_env", "--spec", payload]
    total = str(spec.world_size)
    if launcher == "openmpi":
        _whole_hosts(spec, launcher)
        content = "".join(f"{h} slots={len(s)}\n" for h, s in spec.world.items())
        return [LaunchCommand("mpirun (openmpi)", ["mpirun", "-n", total, "-hostfile", HOSTFILE_PLACEHOLDER,
                                                   "--map-by", "slot", *extra, *shim], files={HOSTFILE_PLACEHOLDER: content})]
    per_node = _uniform_slots(spec, launcher)
    _whole_hosts(spec, launcher)
    if launcher == "mpich":
        return [LaunchCommand("mpirun (mpich)", ["mpirun", "-n", total, "-ppn", str(per_node), "-hosts", ",".join(hosts),
                                                 *extra, *shim])]
    if launcher == "slurm":
        return [LaunchCommand("srun", ["srun", "-n", total, "--nodes", str(len(hosts)), "--ntasks-per-node",
                                       str(per_node), "--nodelist", ",".join(hosts), *extra, *shim])]
    raise LaunchError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
