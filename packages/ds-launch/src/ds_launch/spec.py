"""What a launch runs: the program, the world layout, and each rank's command and environment.

Everything here is pure (no process is started), so the dry run, the local node agent, the remote
node agents and the MPI shim all compute a rank's command and environment the same way.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from dataclasses import dataclass, field

from .resources import LaunchError, Resources

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class Program:
    """The user's program: a script run by Python, a module (``-m``), or an executable."""

    target: str
    args: tuple[str, ...] = ()
    mode: str = "script"  # "script" | "module" | "exec"
    local_rank_arg: bool = True  # pass --local_rank=N before the user's arguments, as DeepSpeed does

    def argv(self, local_rank: int) -> list[str]:
        extra = [f"--local_rank={local_rank}"] if self.local_rank_arg else []
        if self.mode == "exec":
            head = [self.target]
        elif self.mode == "module":
            head = [sys.executable, "-u", "-m", self.target]
        else:
            head = [sys.executable, "-u", self.target]
        return [*head, *extra, *self.args]

    def flags(self) -> list[str]:
        """The options that recreate this program in another process (see `add_program_arguments`)."""
        out = {"module": ["--module"], "exec": ["--no_python"]}.get(self.mode, [])
        if not self.local_rank_arg:
            out.append("--no_local_rank")
        return [*out, "--", self.target, *self.args]


def add_program_arguments(parser) -> None:
    parser.add_argument("-m", "--module", action="store_true",
                        help="run the program as a Python module (python -m), not a script")
    parser.add_argument("--no_python", action="store_true",
                        help="run the program directly as an executable, without the Python interpreter")
    parser.add_argument("--no_local_rank", action="store_true",
                        help="do not pass --local_rank=N to the program (the LOCAL_RANK variable is always set)")
    parser.add_argument("user_script", help="the script, module or executable to run on every rank")
    parser.add_argument("user_args", nargs="...", help="arguments passed on to the program")


def program_from_args(args) -> Program:
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python cannot be used together")
    mode = "module" if args.module else "exec" if args.no_python else "script"
    args_list = list(args.user_args)
    if args_list[:1] == ["--"]:
        args_list = args_list[1:]
    return Program(args.user_script, tuple(args_list), mode, not args.no_local_rank)


def encode_world(world: Resources) -> str:
    payload = json.dumps([[host, slots] for host, slots in world.items()], separators=(",", ":"))
    return base64.urlsafe_b64encode(payload.encode()).decode()


def decode_world(text: str) -> Resources:
    try:
        items = json.loads(base64.urlsafe_b64decode(text.encode()))
        return {str(host): [int(s) for s in slots] for host, slots in items}
    except (ValueError, TypeError) as e:
        raise LaunchError(f"--world_info {text!r} is not a world description made by ds-launch ({e})") from None


@dataclass(frozen=True)
class RankPlan:
    rank: int
    local_rank: int
    node_rank: int
    host: str
    argv: list[str]
    env: dict[str, str]  # what the launcher adds to the inherited environment
    cpus: tuple[int, ...] = ()  # CPU affinity, empty for "inherit"

    @property
    def label(self) -> str:
        return f"rank {self.rank} (local rank {self.local_rank} on node {self.node_rank}, {self.host})"


@dataclass(frozen=True)
class NodeSpec:
    """Everything one node needs to start its ranks."""

    world: Resources
    node_rank: int
    master_addr: str
    master_port: int
    program: Program
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    log_dir: str | None = None
    kill_grace: float = 5.0
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def hosts(self) -> list[str]:
        return list(self.world)

    @property
    def world_size(self) -> int:
        return sum(len(s) for s in self.world.values())

    def first_rank(self, node_rank: int) -> int:
        return sum(len(s) for s in list(self.world.values())[:node_rank])

    def plan(self, accelerators: int | None = None, available_cpus: list[int] | None = None) -> list[RankPlan]:
        """The command and environment of each local rank of this node."""
        from .affinity import split_cores

        host = self.hosts[self.node_rank]
        slots = self.world[host]
        base = self.first_rank(self.node_rank)
        env_common = {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(len(slots)),
            "CROSS_RANK": str(self.node_rank),
            "CROSS_SIZE": str(len(self.world)),
            # torchrun's names, so code written for torchrun runs unchanged
            "GROUP_RANK": str(self.node_rank),
            "GROUP_WORLD_SIZE": str(len(self.world)),
            "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(self.world_size),
            **self.extra_env,
        }
        if accelerators:
            env_common["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
        cores: list[tuple[int, ...]] = [()] * len(slots)
        if self.bind_cores_to_rank:
            cores = split_cores(len(slots), self.bind_core_list, available_cpus)
        plans = []
        for local_rank in range(len(slots)):
            rank = base + local_rank
            env = {**env_common, "RANK": str(rank), "LOCAL_RANK": str(local_rank), "ROLE_RANK": str(rank)}
            if cores[local_rank]:
                env["OMP_NUM_THREADS"] = str(len(cores[local_rank]))
            plans.append(RankPlan(rank, local_rank, self.node_rank, host, self.program.argv(local_rank),
                                  env, cores[local_rank]))
        return plans

    def node_argv(self, node_rank: int | str, watch_stdin: bool = False) -> list[str]:
        """The command that starts node ``node_rank``'s agent (``python -m ds_launch.node ...``)."""
        argv = [sys.executable, "-u", "-m", "ds_launch.node",
                "--world_info", encode_world(self.world), "--node_rank", str(node_rank),
                "--master_addr", self.master_addr, "--master_port", str(self.master_port),
                "--kill_grace", str(self.kill_grace)]
        if self.bind_cores_to_rank:
            argv.append("--bind_cores_to_rank")
        if self.bind_core_list:
            argv += ["--bind_core_list", self.bind_core_list]
        if self.log_dir:
            argv += ["--enable_each_rank_log", os.path.abspath(self.log_dir)]
        if watch_stdin:
            argv.append("--watch_stdin")
        return argv + self.program.flags()
