"""Multi-node runners: the commands that start a launch on several machines.

``ssh`` and ``pdsh`` start a node agent (``python -m ds_launch.node``) on every node through a
remote shell; ``openmpi``, ``mpich``, ``mvapich`` and ``slurm`` start every rank themselves, and
each rank passes through ``python -m ds_launch.rank_env``, which turns the MPI/SLURM variables
into the ones a ds-launch rank sees. Either way the launch (working directory, forwarded
environment, program and arguments) travels as one base64 argument: a remote command line holds
only letters, digits and ``_./=%+-``, so no remote shell of any kind can read user data as code.
The MPI runners add DeepSpeed's defaults (Open MPI's ``--mca`` settings and ``UCX_TLS=tcp``,
MVAPICH's ``MV2_*`` settings) as DeepSpeed's ``multinode_runner.py`` does.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from .resources import LaunchError, local_accelerators, read_lines
from .spec import NodeSpec

LAUNCHERS = ("ssh", "pdsh", "openmpi", "mpich", "mvapich", "slurm")
# Variables forwarded to remote nodes: DeepSpeed's EXPORT_ENVS plus its CUDA accelerator's NCCL,
# and DS_ for our own settings (e.g. DS_OPS_CACHE).
EXPORT_PREFIXES = ("NCCL", "PYTHON", "MV2", "UCX", "MLFLOW", "DS_")
EXPORT_NAMES = ("PATH",)
ENV_FILE_NAME = ".deepspeed_env"
HOSTFILE_PLACEHOLDER = "{hostfile}"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

# What each launcher runs here, for a clear error when it is missing.
BACKENDS = {"ssh": "the OpenSSH client", "pdsh": "pdsh", "openmpi": "Open MPI's mpirun", "mpich": "MPICH's mpirun",
            "mvapich": "MVAPICH's mpirun", "slurm": "SLURM's srun"}
# Open MPI: DeepSpeed's OpenMPIRunner passes these unless the user sets them (mpirun NAME VALUE pairs).
OPENMPI_MCA_DEFAULTS = (("btl", "^openib"), ("btl_tcp_if_include", "eth0"))
# A user's setting of one of these replaces the default of the key (Open MPI refuses include + exclude).
_MCA_REPLACES = {"btl": ("btl",), "btl_tcp_if_include": ("btl_tcp_if_include", "btl_tcp_if_exclude")}
_MCA_OPTIONS = ("-mca", "--mca", "-gmca", "--gmca")
# Open MPI options that choose the placement; without one, ds-launch asks for --map-by slot.
_OPENMPI_MAPPING = ("-map-by", "--map-by", "-bynode", "--bynode", "-byslot", "--byslot", "-npernode", "--npernode",
                    "-pernode", "--pernode", "-N", "-ppr", "--ppr")
# MVAPICH: the variables DeepSpeed's MVAPICHRunner exports (MV2_USE_CUDA only with a GPU), in its order.
MVAPICH_ENV_DEFAULTS = (("MV2_SMP_USE_CMA", "0"), ("MV2_DEBUG_SHOW_BACKTRACE", "1"), ("MV2_USE_CUDA", "1"),
                        ("MV2_SUPPORT_DL", "1"), ("MV2_ENABLE_AFFINITY", "0"), ("MV2_INTER_ALLGATHER_TUNING", "5"),
                        ("MV2_CUDA_USE_NAIVE", "0"))


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
    """What remote ranks get from here: PATH, the NCCL*/PYTHON*/MV2*/UCX*/MLFLOW*/DS_* variables, then
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


def remote_env(environ: dict[str, str] | None = None, cwd: str | None = None) -> dict[str, str]:
    """The environment a multi-node launch gives every rank: `forwarded_env`, with the launch
    directory first on PYTHONPATH, as DeepSpeed's multi-node runners do."""
    cwd = os.path.abspath(cwd or os.getcwd())
    env = forwarded_env(environ, cwd)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, env.get("PYTHONPATH")) if p)
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


def _openmpi_defaults(extra: list[str], environ: dict[str, str]) -> list[str]:
    """DeepSpeed's ``--mca`` defaults, less those the user sets in ``--launcher_args`` or as an
    ``OMPI_MCA_<name>`` variable (Open MPI joins two values of one name, and a command-line value
    would override the variable), then ``--map-by slot`` unless the user chose a placement."""
    given = {extra[i + 1] for i in range(len(extra) - 1) if extra[i] in _MCA_OPTIONS}
    given |= {k[len("OMPI_MCA_"):] for k in environ if k.startswith("OMPI_MCA_")}
    out = []
    for name, value in OPENMPI_MCA_DEFAULTS:
        if not given.intersection(_MCA_REPLACES[name]):
            out += ["--mca", name, value]
    if not any(word in _OPENMPI_MAPPING or word.startswith("--map-by=") for word in extra):
        out += ["--map-by", "slot"]  # rank_env needs the ranks host by host, in hostfile order
    return out


def _split_launcher_args(launcher_args: str) -> list[str]:
    try:
        return shlex.split(launcher_args)
    except ValueError as e:
        raise LaunchError(f"--launcher_args {launcher_args!r}: {e}") from None


def ssh_probe_command(host: str, launcher_args: str = "", ssh_port: int | None = None,
                      connect_timeout: float = 10) -> list[str]:
    """The command that asks whether ``host`` is up through the ssh path a launch uses: the node
    agent's ``--probe`` (the remote Python and ds_launch are there), ssh's connect time bounded
    (the user's own ``-o ConnectTimeout`` in ``launcher_args`` comes first and wins)."""
    port = ["-p", str(ssh_port)] if ssh_port else []
    return ["ssh", "-o", "BatchMode=yes", *port, *_split_launcher_args(launcher_args),
            "-o", f"ConnectTimeout={max(1, round(connect_timeout))}", "--", host,
            remote_command([sys.executable, "-u", "-m", "ds_launch.node", "--probe"])]


def build_commands(launcher: str, spec: NodeSpec, launcher_args: str = "", ssh_port: int | None = None,
                   environ: dict[str, str] | None = None, cwd: str | None = None,
                   extra_env: dict[str, str] | None = None, venv_script: str | None = None) -> list[LaunchCommand]:
    """The local processes that start ``spec``'s world with ``launcher``. ``extra_env``: variables
    every rank gets on top of the forwarded environment (an elastic launch's restart count);
    ``venv_script``: sourced by each node's shell before its agent starts (ssh and pdsh)."""
    extra = _split_launcher_args(launcher_args)
    environ = dict(os.environ if environ is None else environ)
    cwd = os.path.abspath(cwd or os.getcwd())
    env = {**remote_env(environ, cwd), **(extra_env or {})}
    spec = dataclasses.replace(spec, cwd=cwd, env=env)
    payload = spec.encode()
    hosts = spec.hosts

    def agent(node_rank: str) -> str:
        command = remote_command([sys.executable, "-u", "-m", "ds_launch.node", "--spec", payload,
                                  "--node_rank", node_rank, "--watch_stdin"])
        # "&&": a script that fails to source stops the node rather than starting ranks in the wrong environment
        return f". {remote_command([venv_script])} && {command}" if venv_script else command

    if launcher == "ssh":
        port = ["-p", str(ssh_port)] if ssh_port else []
        return [LaunchCommand(f"node {i} ({host})", ["ssh", "-o", "BatchMode=yes", *port, *extra, "--", host,
                                                     agent(str(i))], stop_with_eof=True)
                for i, host in enumerate(hosts)]
    if launcher == "pdsh":
        # pdsh replaces %n with each host's position in the -w list: the node rank. It keeps each
        # remote command's stdin open while it lives, so the agents stop when pdsh is stopped. It
        # waits for every node before it exits, so its report of a failed node is watched for.
        pdsh_env = {} if "PDSH_RCMD_TYPE" in environ else {"PDSH_RCMD_TYPE": "ssh"}
        return [LaunchCommand("pdsh", ["pdsh", "-S", "-b", "-f", "1024", "-w", ",".join(hosts), *extra, agent("%n")],
                              pdsh_env, failure_line=r"^pdsh@\S+: \S+: \S+ exited with exit code (?P<code>\d+)")]
    if spec.bind_cores_to_rank or spec.log_dir:
        raise LaunchError(f"--bind_cores_to_rank and --enable_each_rank_log need the ssh or pdsh launcher, not {launcher}")
    shim = [sys.executable, "-u", "-m", "ds_launch.rank_env", "--spec", payload]
    total = str(spec.world_size)
    if launcher == "openmpi":
        _whole_hosts(spec, launcher)
        content = "".join(f"{h} slots={len(s)}\n" for h, s in spec.world.items())
        # DeepSpeed's OpenMPIRunner exports UCX_TLS=tcp unless the user's environment sets it
        # (the user's value reaches the ranks with the rest of the forwarded environment).
        exports = [] if "UCX_TLS" in env else ["-x", "UCX_TLS=tcp"]
        return [LaunchCommand("mpirun (openmpi)", ["mpirun", "-n", total, "-hostfile", HOSTFILE_PLACEHOLDER,
                                                   *_openmpi_defaults(extra, environ), *extra, *exports, *shim],
                              files={HOSTFILE_PLACEHOLDER: content})]
    per_node = _uniform_slots(spec, launcher)
    _whole_hosts(spec, launcher)
    if launcher == "mpich":
        return [LaunchCommand("mpirun (mpich)", ["mpirun", "-n", total, "-ppn", str(per_node), "-hosts", ",".join(hosts),
                                                 *extra, *shim])]
    if launcher == "mvapich":
        # DeepSpeed's MVAPICHRunner: a hostfile of host names (ours private and temporary, not
        # /tmp/deepspeed_mvapich_hostfile), -np/-ppn, then its MV2_* settings as -env NAME=VALUE.
        gpu = bool(local_accelerators(environ))
        exports = [word for name, value in MVAPICH_ENV_DEFAULTS if name not in env and (gpu or name != "MV2_USE_CUDA")
                   for word in ("-env", f"{name}={value}")]
        content = "".join(f"{h}\n" for h in hosts)
        return [LaunchCommand("mpirun (mvapich)", ["mpirun", "-np", total, "-ppn", str(per_node), "--hostfile",
                                                   HOSTFILE_PLACEHOLDER, *extra, *exports, *shim],
                              files={HOSTFILE_PLACEHOLDER: content})]
    if launcher == "slurm":
        return [LaunchCommand("srun", ["srun", "-n", total, "--nodes", str(len(hosts)), "--ntasks-per-node",
                                       str(per_node), "--nodelist", ",".join(hosts), *extra, *shim])]
    raise LaunchError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")


def check_backend(launcher: str, command: LaunchCommand, environ: dict[str, str] | None = None) -> None:
    """Fail before anything starts when ``launcher``'s program is not installed here. For mvapich,
    as DeepSpeed does, MVAPICH's ``mpiname`` must also say MVAPICH (another MPI's mpirun would
    misread -ppn/-env)."""
    environ = os.environ if environ is None else environ
    search = environ.get("PATH", os.defpath)
    program = command.argv[0]
    if shutil.which(program, path=search) is None:
        raise LaunchError(f"--launcher {launcher} needs {BACKENDS[launcher]} ({program!r}) on PATH; not found")
    if launcher != "mvapich":
        return
    mpiname = shutil.which("mpiname", path=search)
    if mpiname is None:
        raise LaunchError("--launcher mvapich needs MVAPICH's 'mpiname' on PATH (to tell its mpirun from another "
                          "MPI's); not found: is MVAPICH installed, or is this Open MPI (--launcher openmpi) or MPICH?")
    try:
        said = subprocess.run([mpiname], capture_output=True, text=True, timeout=30, env=environ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        raise LaunchError(f"--launcher mvapich: cannot run {mpiname}: {e}") from None
    if "mvapich" not in said.lower():
        raise LaunchError(f"--launcher mvapich: {mpiname} says {said[:80]!r}, not MVAPICH")
