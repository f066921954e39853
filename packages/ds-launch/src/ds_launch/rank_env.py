"""Per-rank shim for launchers that start every rank themselves (Open MPI, MPICH, MVAPICH, SLURM).

``python -u -m ds_launch.rank_env --spec <base64>`` reads its rank from the launcher's variables,
enters the launch's working directory, sets the forwarded environment and the variables a
ds-launch rank gets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
CROSS_RANK, ...), then replaces itself with the program: one environment under every launcher.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from .resources import LaunchError
from .spec import NodeSpec, RankPlan

# (rank, world size, local rank) variables of each launcher family: Open MPI, MVAPICH, MPICH/Hydra, SLURM.
SOURCES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


def rank_from_environment(environ: dict[str, str]) -> tuple[int, int, int | None]:
    for rank_var, size_var, local_var in SOURCES:
        if rank_var in environ and size_var in environ:
            local = environ.get(local_var)
            try:
                return int(environ[rank_var]), int(environ[size_var]), None if local is None else int(local)
            except ValueError:
                raise LaunchError(f"{rank_var}/{size_var}/{local_var} are not integers: "
                                  f"{environ[rank_var]!r}, {environ[size_var]!r}, {local!r}") from None
    names = ", ".join(f"{r}+{s}" for r, s, _ in SOURCES)
    raise LaunchError(f"no launcher told this process its rank: looked for {names}")


def resolve(spec: NodeSpec, environ: dict[str, str]) -> RankPlan:
    """The plan of the rank this process is, checked against the launcher's own numbering."""
    rank, size, local = rank_from_environment(environ)
    if size != spec.world_size:
        raise LaunchError(f"the launcher started {size} processes, but the world has {spec.world_size}")
    node = spec.node_of_rank(rank)
    node_spec = dataclasses.replace(spec, node_rank=node)
    plan = node_spec.plan()[rank - spec.first_rank(node)]
    if local is not None and local != plan.local_rank:
        raise LaunchError(
            f"rank {rank} is local rank {local} to the launcher but {plan.local_rank} in the world layout; "
            "the launcher must place ranks host by host (Open MPI: --map-by slot)")
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_launch.rank_env")
    parser.add_argument("--spec", required=True, help="the launch, as encoded by ds-launch")
    args = parser.parse_args(argv)
    try:
        spec = NodeSpec.decode(args.spec)
        plan = resolve(spec, dict(os.environ))
        if spec.cwd:
            os.chdir(spec.cwd)
    except (LaunchError, OSError) as e:
        print(f"ds-launch rank shim: error: {e}", file=sys.stderr)
        return 2
    os.environ.update({**spec.env, **plan.env})
    try:
        os.execvp(plan.argv[0], plan.argv)
    except OSError as e:
        print(f"ds-launch rank shim: cannot start {plan.argv[0]}: {e.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
