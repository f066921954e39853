"""``ds-launch``: start a training script on one or many machines, DeepSpeed's launcher style.

    ds-launch [options] user_script.py [script args]

Standard library only: the launcher never imports torch, so it starts in a few tens of ms.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

from . import __version__
from .affinity import format_cores
from .resources import (
    DEFAULT_HOSTFILE,
    MAX_SLOTS,
    LaunchError,
    check_hostname,
    check_port_free,
    is_local_address,
    local_accelerators,
    parse_hostfile,
    select_resources,
)
from .runners import (
    LAUNCHERS,
    LaunchCommand,
    build_commands,
    check_backend,
    remote_command,
    remote_env,
)
from .spec import DEFAULT_MASTER_PORT, NodeSpec, Program


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2, no usage dump
        raise LaunchError(f"{message} (see ds-launch --help)")


def _count(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if not 1 <= value <= MAX_SLOTS:
            raise argparse.ArgumentTypeError(f"{name} must be an integer from 1 to {MAX_SLOTS}, got {value}")
        return value
    return parse


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port number 1-65535, got {text!r}")
    return int(text)


def _node_rank(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 3600:
        raise argparse.ArgumentTypeError(f"must be a number of seconds from 0 to 3600, got {text!r}")
    return value


def _elastic_nodes(name: str):
    def parse(text: str) -> int:
        if text != "-1" and not (text.isdigit() and int(text) >= 1):
            raise argparse.ArgumentTypeError(f"{name} must be a positive number of hosts (or -1: the default), "
                                             f"got {text!r}")
        return int(text)
    return parse


def _restarts(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a number of restarts >= 0, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ds-launch",
        description="Launch a distributed training script on this machine or across a cluster. "
                    "Every rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, "
                    "MASTER_PORT, CROSS_RANK and CROSS_SIZE (as under torchrun).",
        allow_abbrev=False,
    )
    p.add_argument("--version", action="version", version=f"ds-launch {__version__}")
    r = p.add_argument_group("resources")
    r.add_argument("-H", "--hostfile", default=None,
                   help=f"'hostname slots=N' per line (default: {DEFAULT_HOSTFILE} if it exists, else this machine)")
    r.add_argument("-i", "--include", default="",
                   help="use only these hosts/slots, e.g. 'host1:0,1@host2' (DeepSpeed syntax)")
    r.add_argument("-e", "--exclude", default="", help="use every host/slot but these, e.g. 'host1:0@host3'")
    r.add_argument("--num_nodes", type=_count("--num_nodes"), default=None, help="use the first N hosts")
    r.add_argument("--num_gpus", "--num_accelerators", "--num_procs", dest="num_procs",
                   type=_count("--num_gpus"), default=None,
                   help="processes per node (default: one per GPU, or 1 on a machine without GPUs)")
    r.add_argument("--node_rank", type=_node_rank, default=None,
                   help="start only this node's ranks here (run ds-launch on each node yourself, as with torchrun)")
    n = p.add_argument_group("rendezvous and multi-node")
    n.add_argument("--master_addr", default="",
                   help="address of rank 0 (default: 127.0.0.1 on one node, else the first host)")
    n.add_argument("--master_port", type=_port, default=DEFAULT_MASTER_PORT, help="rank 0's TCP port (default 29500)")
    n.add_argument("--launcher", type=str.lower, choices=LAUNCHERS, default=None,
                   help="how to reach other nodes, any case as in DeepSpeed (default: ssh when there is more than one)")
    n.add_argument("--launcher_args", default="", help="extra arguments for the launcher command, as one string")
    n.add_argument("--ssh_port", type=_port, default=None, help="ssh port of the remote nodes")
    n.add_argument("--force_multi", action="store_true",
                   help="use the multi-node launcher even for a single node")
    n.add_argument("--no_ssh", action="store_true",
                   help="DeepSpeed's launch without ssh: start only this node's ranks (needs --node_rank; run "
                        "ds-launch on each node yourself)")
    n.add_argument("--no_ssh_check", action="store_true",
                   help="accepted for DeepSpeed: ds-launch makes no ssh check before a launch (an unreachable node "
                        "fails the launch, named)")
    n.add_argument("--venv_script", default=None, metavar="PATH",
                   help="a script each node sources before the ranks start (ssh and pdsh launchers), e.g. a "
                        "virtualenv's bin/activate")
    el = p.add_argument_group("elastic training (restart at a new size when a node is lost or joins)")
    el.add_argument("--elastic_training", "--elastic", action="store_true",
                    help="run on the hosts that are up and restart every rank at a size the training config's "
                         "elasticity section allows when a node is lost or joins (ssh launcher; the script resumes "
                         "from its latest checkpoint and gets TORCHELASTIC_RESTART_COUNT)")
    el.add_argument("--min_elastic_nodes", "--min_nodes", type=_elastic_nodes("--min_elastic_nodes"), default=-1,
                    help="the fewest hosts a round starts with (default 1)")
    el.add_argument("--max_elastic_nodes", "--max_nodes", type=_elastic_nodes("--max_elastic_nodes"), default=-1,
                    help="the most hosts a round uses (default: every host of the hostfile)")
    el.add_argument("--max_restarts", type=_restarts, default=None,
                    help="restarts after a failure before giving up (default 100, as DeepSpeed's elastic agent; "
                         "a node joining does not count)")
    el.add_argument("--elastic_timeout", type=_seconds, default=None,
                    help="seconds the rendezvous waits for --min_elastic_nodes hosts to be up (default 100)")
    el.add_argument("--monitor_interval", type=_seconds, default=None,
                    help="seconds between looks for hosts that came up during a round (default 5)")
    b = p.add_argument_group("processes")
    b.add_argument("--bind_cores_to_rank", action="store_true",
                   help="split this node's cores evenly among its ranks and set OMP_NUM_THREADS")
    b.add_argument("--bind_core_list", default=None, help="the cores to split, e.g. '0-7,16-23'")
    b.add_argument("--enable_each_rank_log", metavar="DIR", default=None,
                   help="write each rank's stdout and stderr to DIR/rank<N>.log")
    b.add_argument("--save_pid", nargs="?", const="", default=None, metavar="PATH",
                   help="a flag, as in DeepSpeed: write the launcher's pid to /tmp/<pid>.deepspeed; "
                        "--save_pid=PATH writes it to PATH instead (the value only with '=')")
    b.add_argument("--kill_grace", type=_seconds, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)")
    b.add_argument("--dry_run", action="store_true",
                   help="print every node's command and environment, start nothing")
    g = p.add_argument_group("program")
    g.add_argument("-m", "--module", action="store_true",
                   help="run the program as a Python module (python -m), not a script")
    g.add_argument("--no_python", action="store_true",
                   help="run the program directly as an executable, without the Python interpreter")
    g.add_argument("--no_local_rank", action="store_true",
                   help="do not pass --local_rank=N to the program (the LOCAL_RANK variable is always set)")
    g.add_argument("--deepspeed_alias", action="store_true",
                   help="run an unmodified DeepSpeed script on ds_all: in the ranks, for this launch only, "
                        "'import deepspeed' gives ds_all and deepspeed.X gives ds_all.X (refused when a real "
                        "DeepSpeed is importable)")
    lg = p.add_argument_group("messages")
    lg.add_argument("--log_level", choices=("debug", "info", "warning", "error", "critical"), default="info",
                    help="ds-launch's own messages: its warnings show at warning or below (default info)")
    lg.add_argument("-q", "--quiet", action="store_true", help="--log_level error")
    p.add_argument("--autotuning", choices=("tune", "run"), default=None,
                   help="autotune the script's DeepSpeed config with the ds-autotune command (run: then train "
                        "with the best config found)")
    p.add_argument("user_script", help="the script, module or executable to run on every rank")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments passed on to the program")
    return p


def _value_options(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option string that takes exactly one value -> the option's long name."""
    out = {}
    for action in parser._actions:
        if action.option_strings and action.nargs is None and action.option_strings[0] != "--save_pid":
            long = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
            out.update(dict.fromkeys(action.option_strings, long))
    return out


def _normalize(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Rewrite the launcher's own options (those before the program) so argparse cannot misread them.

    * ``--opt VALUE`` becomes ``--opt=VALUE`` for every option that takes a value, so a value that
      starts with '-' is taken as the value: ``--launcher_args '-mca btl_tcp_if_include eth1'``
      (argparse would read ``-mca`` as ``-m`` with ``ca``) or ``--launcher_args --oversubscribe``.
      A next word that is itself one of our options is left alone (argparse then says the value
      is missing).
    * a bare ``--save_pid`` becomes ``--save_pid=``: a flag, as in DeepSpeed; it never takes the
      script as its path (a path is given only as ``--save_pid=PATH``).
    """
    values = _value_options(parser)
    known = set(parser._option_string_actions)
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        if word == "--" or word == "-" or not word.startswith("-"):
            return out + argv[i:]  # the program and its arguments: untouched
        if word == "--save_pid":
            out.append("--save_pid=")
        elif word in values and i + 1 < len(argv) and argv[i + 1] not in known \
                and argv[i + 1].split("=", 1)[0] not in known:
            out.append(f"{values[word]}={argv[i + 1]}")
            i += 1
        else:
            out.append(word)
        i += 1
    return out


def _unknown_option(parser: argparse.ArgumentParser, word: str) -> LaunchError:
    name = word.split("=", 1)[0]
    longs = [o for o in parser._option_string_actions if o.startswith("--")]
    close = difflib.get_close_matches(name, longs, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return LaunchError(f"unrecognized option {name!r}{hint} (see ds-launch --help)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args, unknown = parser.parse_known_args(_normalize(parser, argv))
    if unknown:
        option = next((w for w in unknown if w.startswith("-")), None)
        if option is not None:
            raise _unknown_option(parser, option)
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _program(args) -> Program:
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python cannot be used together")
    mode = "module" if args.module else "exec" if args.no_python else "script"
    program = Program(args.user_script, tuple(args.user_args), mode, not args.no_local_rank)
    if mode == "script" and not os.path.isfile(program.target):
        hint = "; --save_pid takes no value, use --save_pid=PATH" if args.save_pid == "" else ""
        raise LaunchError(f"user script {program.target!r} not found (working directory {os.getcwd()}){hint}")
    if mode == "exec" and shutil.which(program.target) is None:
        raise LaunchError(f"executable {program.target!r} not found on PATH or not executable")
    return program


def _warn(args, message: str) -> None:
    if not args.quiet and args.log_level in ("debug", "info", "warning"):
        print(f"ds-launch: warning: {message}", file=sys.stderr)


def _resources(args):
    hostfile = args.hostfile
    if hostfile is None and os.path.isfile(DEFAULT_HOSTFILE):
        hostfile = DEFAULT_HOSTFILE
    if hostfile is not None:
        available = parse_hostfile(hostfile)
    else:
        gpus = len(local_accelerators())
        available = {"localhost": list(range(gpus or args.num_procs or 1))}
    return select_resources(available, args.include, args.exclude, args.num_nodes, args.num_procs)


def make_plan(argv: list[str]):
    """Parse and check the command line: (args, spec, multi-node launcher or None)."""
    args = parse_args(argv)
    program = _program(args)
    if args.bind_core_list is not None and not args.bind_cores_to_rank:
        raise LaunchError("--bind_core_list needs --bind_cores_to_rank")
    if args.no_ssh and args.node_rank is None:
        raise LaunchError("--no_ssh starts only this node's ranks: give its --node_rank (0 for the first host), and "
                          "run ds-launch on every node")
    if args.venv_script is not None:
        try:
            remote_command([args.venv_script])  # sourced by a remote shell: plain text only
        except LaunchError:
            raise LaunchError(f"--venv_script {args.venv_script!r}: the path may hold only letters, digits and "
                              "_./=%+- (a remote shell sources it)") from None
    if args.node_rank is not None and (args.launcher or args.force_multi):
        raise LaunchError("--node_rank starts one node's ranks here; it cannot be combined with --launcher/--force_multi")
    world = _resources(args)
    multi = args.node_rank is None and (len(world) > 1 or args.force_multi or args.elastic_training)
    if args.elastic_training or any(getattr(args, name) != default for _, name, default in ELASTIC_ONLY):
        from ._elastic import check_args

        check_args(args)
    if args.node_rank is not None and args.node_rank >= len(world):
        raise LaunchError(f"--node_rank {args.node_rank} is outside 0..{len(world) - 1} (the hosts: {', '.join(world)})")
    if not multi:
        unused = [o for o, v in (("--launcher", args.launcher), ("--launcher_args", args.launcher_args),
                                 ("--ssh_port", args.ssh_port), ("--venv_script", args.venv_script)) if v]
        if unused:
            _warn(args, f"{', '.join(unused)} ignored: this is a single-node launch (add --force_multi to use them)")
    if args.master_addr:
        master = args.master_addr
    elif multi or args.node_rank is not None:
        master = next(iter(world))
    else:
        master = "127.0.0.1"
    check_hostname(master, "--master_addr", allow_ip=True)
    node_rank = args.node_rank or 0
    if args.deepspeed_alias:
        from ._alias import check_alias

        check_alias(program, multi)
    spec = NodeSpec(world, node_rank, master, args.master_port, program, args.bind_cores_to_rank,
                    args.bind_core_list, args.enable_each_rank_log, args.kill_grace,
                    deepspeed_alias=args.deepspeed_alias)
    launcher = (args.launcher or "ssh") if multi else None
    return args, spec, launcher


def _run_elastic(args, spec: NodeSpec) -> int:
    from ._elastic import allowed_sizes, config_path, options_from_args, run_elastic

    options = options_from_args(args, spec.world)
    path = config_path(spec.program.args)
    batch, allowed = allowed_sizes(path)
    if args.dry_run:
        print(f"ds-launch dry run: elastic training over {', '.join(spec.world)}: nodes {options.min_nodes}.."
              f"{options.max_nodes}, global batch {batch}, allowed world sizes {allowed}, at most "
              f"{options.max_restarts} failure restart(s); each round starts the hosts that are up, as below for all")
        _print_dry_run(spec, build_commands("ssh", spec, args.launcher_args, args.ssh_port,
                                            venv_script=args.venv_script))
        return 0
    check_backend("ssh", build_commands("ssh", spec, args.launcher_args, args.ssh_port)[0])
    return run_elastic(spec, options, allowed, args.launcher_args, args.ssh_port, args.master_addr,
                       venv_script=args.venv_script)


# the elastic options and their defaults (given without --elastic_training they are an error)
ELASTIC_ONLY = (("--min_elastic_nodes", "min_elastic_nodes", -1), ("--max_elastic_nodes", "max_elastic_nodes", -1),
                ("--max_restarts", "max_restarts", None), ("--elastic_timeout", "elastic_timeout", None),
                ("--monitor_interval", "monitor_interval", None))


def _print_dry_run(spec: NodeSpec, commands: list[LaunchCommand] | None) -> None:
    where = f"launcher {commands[0].argv[0]}" if commands else "this machine"
    print(f"ds-launch dry run: {len(spec.world)} node(s), {spec.world_size} rank(s), "
          f"master {spec.master_addr}:{spec.master_port}, {where}")
    for cmd in commands or []:
        print(f"\n[{cmd.label}] local command:")
        for placeholder, content in cmd.files.items():
            print(f"  {placeholder} = a temporary file holding:")
            print("".join(f"    {line}\n" for line in content.splitlines()), end="")
        for name, value in cmd.env.items():
            print(f"  env {name}={shlex.quote(value)}")
        print(f"  {shlex.join(cmd.argv)}")
    if commands:
        print(f"\nevery node: working directory {shlex.quote(os.getcwd())}, forwarded environment:")
        print("  " + " ".join(f"{k}={shlex.quote(v)}" for k, v in remote_env().items()))
    nodes = range(len(spec.world)) if commands else [spec.node_rank]
    devices = local_accelerators()
    for node in nodes:
        node_spec = dataclasses.replace(spec, node_rank=node)
        print(f"\n[node {node} ({node_spec.hosts[node]})] ranks, as the node agent starts them"
              f"{' (GPUs and cores as seen on this machine)' if commands else ''}:")
        for plan in node_spec.plan(visible_devices=devices):
            cores = f"  (cores {format_cores(plan.cpus)})" if plan.cpus else ""
            print(f"  rank {plan.rank}, local rank {plan.local_rank}{cores}:")
            print("    env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env.items()))
            print(f"    {shlex.join(plan.argv)}")


def _run_multi(spec: NodeSpec, commands: list[LaunchCommand]) -> int:
    from .supervise import Supervisor, spawn

    written = []
    try:
        with Supervisor(spec.kill_grace) as supervisor:
            for cmd in commands:
                argv = list(cmd.argv)
                for placeholder, content in cmd.files.items():
                    fd, path = tempfile.mkstemp(prefix="ds-launch-", text=True)  # private, never a symlink
                    written.append(path)
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        f.write(content)
                    argv = [path if a == placeholder else a for a in argv]
                # stdin is a pipe we never write: a remote agent stops when it closes
                supervisor.add(spawn(cmd.label, argv, {**os.environ, **cmd.env}, stdin=subprocess.PIPE,
                                     stop_with_eof=cmd.stop_with_eof, failure_line=cmd.failure_line))
            return supervisor.watch()
    finally:
        for path in written:
            _remove(path)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


PID_FILE_DIR = "/tmp"  # DeepSpeed's PID_FILE_BASEPATH


def _write_pid_file(path: str) -> str:
    """``path`` or, when empty, DeepSpeed's ``/tmp/<pid>.deepspeed``; never follows a symlink and
    never overwrites a file that is not a pid file (``--save_pid=train.py`` would destroy the script)."""
    if not path:
        path = os.path.join(PID_FILE_DIR, f"{os.getpid()}.deepspeed")
    try:
        with open(path, "rb") as f:
            old = f.read(64)
    except OSError:
        old = None
    if old is not None and old.strip() and not old.strip().isdigit():
        raise LaunchError(f"--save_pid={path}: the file exists and does not hold a pid; refusing to overwrite it")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")
    except OSError as e:
        raise LaunchError(f"--save_pid={path}: cannot write the pid file: {e.strerror}") from None
    return path


def _run_autotuning(mode: str, argv: list[str], script: str) -> int:
    """``--autotuning tune|run``: the same command line (without the flag) handed to ``ds-autotune``."""
    rest = list(argv)
    end = rest.index(script) if script in rest else len(rest)  # the launcher's options come before the script
    for i, word in enumerate(rest[:end]):
        if word == "--autotuning" or word.startswith("--autotuning="):
            del rest[i:i + (1 if "=" in word else 2)]
            break
    command = shutil.which("ds-autotune")
    if command is None:
        raise LaunchError("--autotuning needs the ds-autotune command, which is not installed: "
                          "pip install ds-autotune")
    return subprocess.run([command, mode, *rest]).returncode


def run(argv: list[str]) -> int:
    args, spec, launcher = make_plan(argv)
    if args.autotuning:
        return _run_autotuning(args.autotuning, argv, args.user_script)
    if args.elastic_training:
        pid_file = _write_pid_file(args.save_pid) if args.save_pid is not None and not args.dry_run else None
        try:
            return _run_elastic(args, spec)
        finally:
            if pid_file:
                _remove(pid_file)
    commands = None
    if launcher:
        if args.venv_script is not None and launcher not in ("ssh", "pdsh"):
            _warn(args, f"--venv_script ignored: the {launcher} launcher starts the ranks itself (as in DeepSpeed, "
                        "only ssh/pdsh nodes source it)")
        commands = build_commands(launcher, spec, args.launcher_args, args.ssh_port, venv_script=args.venv_script)
    if args.dry_run:
        _print_dry_run(spec, commands)
        return 0
    if commands:
        check_backend(launcher, commands[0])
    if spec.node_rank == 0 and is_local_address(spec.master_addr):
        check_port_free(spec.master_addr, spec.master_port)
    pid_file = _write_pid_file(args.save_pid) if args.save_pid is not None else None
    try:
        if commands:
            return _run_multi(spec, commands)
        from .node import run_node

        return run_node(spec)
    finally:
        if pid_file:
            _remove(pid_file)


def main(argv: list[str] | None = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except LaunchError as e:
        print(f"ds-launch: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
