"""Process-group life: discover rank and world size, initialise torch.distributed, tear it down."""

from __future__ import annotations

import logging
import os
import re
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# (who sets them, rank, world size, local rank)
_SOURCES = (
    ("ds-launch/torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("SLURM", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)
BACKENDS = ("gloo", "nccl", "mpi", "ucc")


def first_slurm_host(nodelist: str) -> str:
    """``"node[03-05,7],login1"`` → ``"node03"`` (SLURM's compressed host list)."""
    m = re.match(r"([^\[,]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"SLURM_NODELIST {nodelist!r} is not a host list")
    prefix, ranges = m.group(1), m.group(2)
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def _discover(environ) -> tuple[str, int, int, int] | None:
    for source, rank_var, size_var, local_var in _SOURCES:
        if rank_var in environ and size_var in environ:
            try:
                return source, int(environ[rank_var]), int(environ[size_var]), int(environ.get(local_var, 0))
            except ValueError:
                raise ValueError(f"init_distributed: {rank_var}={environ[rank_var]!r}, {size_var}={environ[size_var]!r} "
                                 "are not integers") from None
    return None


def init_distributed(dist_backend: str | None = None, timeout: timedelta = timedelta(minutes=30),
                     init_method: str | None = None, rank: int = -1, world_size: int = -1,
                     auto_mpi_discovery: bool = True) -> None:
    """Initialise the default process group once (later calls return at once).

    Rank and world size come from the arguments, else from ds-launch/torchrun (RANK, WORLD_SIZE),
    else, with ``auto_mpi_discovery``, from Open MPI (OMPI_COMM_WORLD_*) or SLURM (SLURM_PROCID,
    SLURM_NTASKS; the master is SLURM_NODELIST's first host). The backend defaults to nccl when CUDA
    is usable, else gloo.
    """
    if dist.is_initialized():
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in BACKENDS:
        raise ValueError(f"init_distributed: dist_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    environ = os.environ
    local_rank = int(environ.get("LOCAL_RANK", 0))
    if rank < 0 or world_size < 0:
        found = _discover(environ) if auto_mpi_discovery else _discover({k: environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in environ})
        if found is None:
            looked = "; ".join(f"{r}+{s} ({who})" for who, r, s, _ in (_SOURCES if auto_mpi_discovery else _SOURCES[:1]))
            raise RuntimeError(f"init_distributed: nothing tells this process its rank and world size; looked for {looked}. "
                               "Start it with ds-launch (or torchrun), or pass rank= and world_size=")
        source, rank, world_size, local_rank = found
        if source != "ds-launch/torchrun":  # make the torch variables agree for everything that reads them
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
            if source == "SLURM" and "MASTER_ADDR" not in environ and "SLURM_NODELIST" in environ:
                os.environ["MASTER_ADDR"] = first_slurm_host(environ["SLURM_NODELIST"])
    if not 0 <= rank < world_size:
        raise ValueError(f"init_distributed: rank must be in 0..world_size-1, got rank={rank}, world_size={world_size}")
    if init_method is None:
        missing = [v for v in ("MASTER_ADDR",) if v not in os.environ]
        if missing:
            raise RuntimeError(f"init_distributed: {', '.join(missing)} is not set: where rank 0 listens "
                               "(ds-launch sets it; or pass init_method='tcp://host:port')")
        os.environ.setdefault("MASTER_PORT", "29500")
        init_method = "env://"
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, timeout=timeout, rank=rank, world_size=world_size)
    logger.info("ds_comm: rank %d of %d initialised (%s)", rank, world_size, backend)


def _require(call: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"ds_comm.{call}: the process group is not initialised; call ds_comm.init_distributed() first")


def is_initialized() -> bool:
    return dist.is_initialized()


def get_rank(group=None) -> int:
    _require("get_rank")
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    _require("get_world_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's index on its node (LOCAL_RANK, or the MPI/SLURM equivalent); 0 if unknown."""
    for _, _, _, local_var in _SOURCES:
        if local_var in os.environ:
            return int(os.environ[local_var])
    return 0


def get_global_rank(group, group_rank: int) -> int:
    _require("get_global_rank")
    return dist.get_global_rank(group, group_rank)


def new_group(ranks=None, timeout: timedelta | None = None, backend: str | None = None):
    _require("new_group")
    return dist.new_group(ranks=ranks, timeout=timeout, backend=backend)


def destroy_process_group(group=None) -> None:
    """Leave together, then tear down: a rank that destroys gloo while a peer is still finishing its
    last collective can make that peer abort."""
    if not dist.is_initialized():
        return
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    from .logger import comms_logger

    if group is None:
        comms_logger.reset_sequences()
