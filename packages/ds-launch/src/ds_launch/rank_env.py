"""Per-rank shim for launchers that start every rank themselves (Open MPI, MPICH, SLURM).

``python -m ds_launch.rank_env --world_info ... --master_addr A --master_port P -- program args``
reads the rank from the launcher's variables, sets the same variables a ds-launch rank gets
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, CROSS_RANK, ...)
and replaces itself with the program, so user code sees one environment under every launcher.
"""

from __future__ import annotations

import argparse
import os
import sys

from .resources import LaunchError
from .spec import NodeSpec, add_program_arguments, decode_world, program_from_args

# (rank, world size, local rank) variables of each launcher family, in the order they are tried.
SOURCES = {
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
}


def rank_from_environment(environ: dict[str, str]) -> tuple[int, int, int | None]:
    for rank_var, size_var, local_var in SOURCES.values():
        if rank_var in environ and size_var in environ:
            local = environ.get(local_var)
            try:
                return int(environ[rank_var]), int(environ[size_var]), None if local is None else int(local)
            except ValueError:
                raise LaunchError(f"{rank_var}/{size_var}/{local_var} are not integers: "
                                  f"{environ[rank_var]!r}, {environ[size_var]!r}, {local!r}") from None
    names = ", ".join(f"{r}+{s}" for r, s, _ in SOURCES.values())
    raise LaunchError(f"no launcher told this process its rank: looked for {names}")


def resolve(spec_world, master_addr: str, master_port: int, program, environ: dict[str, str]):
    """The plan of the rank this process is, checked against the launcher's own numbering."""
    rank, size, local = rank_from_environment(environ)
    probe = NodeSpec(spec_world, 0, master_addr, master_port, program)
    if size != probe.world_size:
        raise LaunchError(f"the launcher started {size} processes, but the world has {probe.world_size}")
    for node_rank in range(len(spec_world)):
        first = probe.first_rank(node_rank)
        if first <= rank < first + len(list(spec_world.values())[node_rank]):
            plan = NodeSpec(spec_world, node_rank, master_addr, master_port, program).plan()[rank - first]
            if local is not None and local != plan.local_rank:
                raise LaunchError(
                    f"rank {rank} is local rank {local} to the launcher but {plan.local_rank} in the world layout; "
                    "the launcher must place ranks host by host (Open MPI: --map-by slot)")
            return plan
    raise LaunchError(f"rank {rank} is outside the world of {probe.world_size} ranks")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_launch.rank_env")
    parser.add_argument("--world_info", required=True)
    parser.add_argument("--master_addr", required=True)
    parser.add_argument("--master_port", type=int, required=True)
    add_program_arguments(parser)
    args = parser.parse_args(argv)
    try:
        plan = resolve(decode_world(args.world_info), args.master_addr, args.master_port,
                       program_from_args(args), dict(os.environ))
    except LaunchError as e:
        print(f"ds-launch rank shim: error: {e}", file=sys.stderr)
        return 2
    os.environ.update(plan.env)
    try:
        os.execvp(plan.argv[0], plan.argv)
    except OSError as e:
        print(f"ds-launch rank shim: cannot start {plan.argv[0]}: {e.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
