"""What a launch runs: the program, the world layout, and each rank's command and environment.

Everything here is pure (no process is started), so the dry run, the local node agent, the remote
node agents and the MPI shim all compute a rank's command and environment the same way.

A `NodeSpec` travels to other machines as one URL-safe base64 JSON argument (``--spec``): the
working directory, forwarded environment, program and arguments never pass through a remote
shell as text, so no shell (bash, zsh, fish, csh) can read any of it as code.
"""

from __future__ import annotations

import base64
import dataclasses
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
    cwd: str | None = None  # a remote node enters it first
    env: dict[str, str] = field(default_factory=dict)  # a remote node adds it to its environment
    deepspeed_alias: bool = False  # ranks import ds_all as `deepspeed` (the alias folder first on PYTHONPATH)

    @property
    def hosts(self) -> list[str]:
        return list(self.world)

    @property
    def world_size(self) -> int:
        return sum(len(s) for s in self.world.values())

    def first_rank(self, node_rank: int) -> int:
        return sum(len(s) for s in list(self.world.values())[:node_rank])

    def node_of_rank(self, rank: int) -> int:
        for node_rank in range(len(self.world)):
            if rank < self.first_rank(node_rank + 1):
                return node_rank
        raise LaunchError(f"rank {rank} is outside the world of {self.world_size} ranks")

    def plan(self, visible_devices: list[str] | None = None, available_cpus: list[int] | None = None) -> list[RankPlan]:
        """The command and environment of each local rank of this node. ``visible_devices``: the
        node's GPU ids (its CUDA_VISIBLE_DEVICES entries, or 0..n-1); empty or None on a CPU node."""
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
        }
        if visible_devices:
            missing = [s for s in slots if s >= len(visible_devices)]
            if missing:
                raise LaunchError(f"host {host} has slots {missing} but only {len(visible_devices)} visible GPU(s) "
                                  f"({','.join(visible_devices)})")
            env_common["CUDA_VISIBLE_DEVICES"] = ",".join(visible_devices[s] for s in slots)
        if self.deepspeed_alias:
            from ._alias import alias_dir

            # this node's copy of the alias folder, before the PYTHONPATH the ranks would get anyway
            inherited = {**os.environ, **self.env}.get("PYTHONPATH")
            env_common["PYTHONPATH"] = os.pathsep.join(p for p in (alias_dir(), inherited) if p)
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

    def encode(self) -> str:
        """This spec, less the node rank, as one shell-neutral argument (URL-safe base64 JSON)."""
        data = dataclasses.asdict(self)
        del data["node_rank"]
        data["world"] = [[host, slots] for host, slots in self.world.items()]
        payload = json.dumps(data, separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(payload).decode()

    @classmethod
    def decode(cls, text: str, node_rank: int = 0) -> NodeSpec:
        try:
            data = json.loads(base64.urlsafe_b64decode(text.encode()))
            data["world"] = {str(h): [int(s) for s in slots] for h, slots in data["world"]}
            program = data.pop("program")
            program["args"] = tuple(program["args"])
            spec = cls(node_rank=node_rank, program=Program(**program), **data)
        except (ValueError, TypeError, KeyError) as e:
            raise LaunchError(f"--spec is not a launch description made by this ds-launch version ({e})") from None
        if not 0 <= node_rank < len(spec.world):
            raise LaunchError(f"--node_rank {node_rank} is outside 0..{len(spec.world) - 1}")
        return spec
