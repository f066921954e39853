"""Process-group life: discover rank and world size, initialise torch.distributed, tear it down.

Leaving is part of the life: `init_distributed` registers an exit hook so that a rank's exit code
is the one it chose (gloo's threads are stopped while the interpreter is still whole), and a rank
whose collective was diagnosed as hung leaves at once instead of waiting in gloo for its peer.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous as _rendezvous

logger = logging.getLogger(__name__)

# (who sets them, rank, world size, local rank)
_SOURCES = (
    ("ds-launch/torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("SLURM", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)
BACKENDS = ("gloo", "nccl", "mpi", "ucc")
EXIT_WAIT_S = 10.0  # at exit, how long a rank waits for its peers to leave too before it tears down alone
HUNG_EXIT_CODE = 1  # the exit status of a rank whose group is broken by a diagnosed hang

_teardown_callbacks: list[Callable[[], None]] = []
_group_timeout: timedelta | None = None  # the timeout the default group was made with (NCCL's watchdog acts at it)
_exit_hook_registered = False
_broken: str | None = None  # why the group cannot be used any more (a diagnosed hang), or None
_generation = 0  # default groups init_distributed has made in this process (the same count on every rank)


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


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True, timeout: timedelta = timedelta(minutes=30),
                     init_method: str | None = None, dist_init_required: bool | None = None, config: Any = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Initialise the default process group once (later calls return at once); DeepSpeed's
    signature, argument for argument.

    Rank and world size come from the arguments, else from ds-launch/torchrun (RANK, WORLD_SIZE),
    else, with ``auto_mpi_discovery``, from Open MPI (OMPI_COMM_WORLD_*) or SLURM (SLURM_PROCID,
    SLURM_NTASKS; the master is SLURM_NODELIST's first host). The backend defaults to nccl when CUDA
    is usable, else gloo. ``distributed_port`` is MASTER_PORT when the environment has none;
    ``dist_init_required=False`` creates no process group (the caller made or will make one);
    ``config`` (DeepSpeed passes its config through) is not read.
    """
    global _group_timeout
    if dist.is_initialized() or dist_init_required is False:
        return
    backend = _default_backend(dist_backend)
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
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
        init_method = "env://"
    if backend == "nccl" and torch.cuda.is_available():  # each rank its own GPU, before NCCL makes a communicator
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    # torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when it is first
    # imported: imported after the group exists (torch._dynamo imports it, and the first torch.optim
    # optimizer imports torch._dynamo), ten functions keep the group alive for good, so
    # destroy_process_group cannot stop gloo's threads and a rank can abort at exit. Importing it
    # first binds None instead. It costs 2-6 ms here (torch._dynamo itself would cost 0.8 s).
    importlib.import_module("torch.distributed.nn")

    # NCCL: ``timeout`` is also its watchdog's limit; a collective running past it takes the process
    # down (torch's TORCH_NCCL_ASYNC_ERROR_HANDLING, left as the user set it). The comms logger's
    # hang diagnosis waits with its own, shorter limit (see ds_comm.logger).
    if backend == "mpi":  # MPI brings its own rendezvous: no store
        dist.init_process_group(backend, timeout=timeout, rank=rank, world_size=world_size)
    else:
        dist.init_process_group(backend, store=_generation_store(init_method, rank, world_size, timeout),
                                timeout=timeout, rank=rank, world_size=world_size)
    _group_timeout = timeout
    _register_exit_hook()
    if verbose:
        logger.info("ds_comm: rank %d of %d initialised (%s)", rank, world_size, backend)


def _generation_store(init_method: str, rank: int, world_size: int, timeout: timedelta) -> Any:
    """The store of a new default group, in a namespace of its own: this process's `_generation`-th.

    A group made again after `destroy_process_group` (an `initialize` after `destroy()`) meets the same
    address and port, and torch makes the group's store there multi-tenant: while anything still holds
    the previous group (a destroyed engine the caller still names, an optimizer, a cached subgroup),
    rank 0's new store silently joins the previous one's server, keys and all, and the new group is
    named "0" again. A rank would read its peer's previous gloo address and pair with that dead
    generation's context while the peer waits for it: a hang in `init_process_group` or in the first
    collective. Here each generation's keys live under their own prefix, and the other ranks wait
    until rank 0 has announced this generation on the server they reached: one that closes under them
    (rank 0 was still tearing the previous group down), while they join it or while they wait, is
    left for a fresh connection."""
    global _generation
    _generation += 1
    announced = f"ds_comm/generation/{_generation}"
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        if rank == 0:
            store, _, _ = next(_rendezvous(init_method, rank, world_size, timeout=timeout))
            store.set_timeout(timeout)
            store.set(announced, "1")
            break
        store = None
        try:  # the previous generation's server can close under any step: joining it or waiting on it
            store, _, _ = next(_rendezvous(init_method, rank, world_size, timeout=timeout))
            store.set_timeout(timeout)
            store.wait([announced])
            break
        except dist.DistNetworkError:  # closed by rank 0 meanwhile: reach the new one afresh
            if time.monotonic() >= deadline:
                raise
            del store
            time.sleep(0.05)
    return dist.PrefixStore(f"ds_comm/{_generation}/default_pg", store)


def _default_backend(dist_backend: str | None = None) -> str:
    """The backend `init_distributed` uses: ``dist_backend`` when given, else nccl when this process
    has a usable GPU (DeepSpeed's CUDA accelerator's choice), else gloo."""
    return dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")


def _group_timeout_now() -> timedelta | None:
    """The timeout `init_distributed` made the default group with (None if ds_comm did not make it)."""
    return _group_timeout if dist.is_initialized() else None


def _require(call: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"ds_comm.{call}: the process group is not initialised; call ds_comm.init_distributed() first")


def _require_usable(call: str) -> None:
    """`_require` for communication: also fails at once on a group broken by a diagnosed hang."""
    if _broken is not None:
        raise RuntimeError(f"ds_comm.{call}: the process group is broken by a diagnosed hang ("
                           f"{_broken.splitlines()[0]}); restart the job")
    _require(call)


def _on_teardown(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the default group is destroyed (by `destroy_process_group` or at exit),
    before torch tears it down: the other modules of ds_comm free what they keep per group."""
    _teardown_callbacks.append(callback)


def _teardown() -> None:
    for callback in _teardown_callbacks:
        try:
            callback()
        except Exception:  # one module's cleanup must not keep the others from theirs
            logger.exception("ds_comm: a teardown step failed")


def _mark_broken(reason: str) -> None:
    """After a diagnosed hang: every later ds_comm call fails at once, and the process leaves at exit
    with `HUNG_EXIT_CODE` without touching gloo (whose threads still wait for the stuck peer)."""
    global _broken
    _broken = reason
    _teardown()


def _register_exit_hook() -> None:
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_leave_at_exit)
        _exit_hook_registered = True


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    logging.shutdown()
    os._exit(code)


def _leave_at_exit() -> None:
    """The exit hook: tear the group down while the interpreter is whole, so that no gloo thread is
    left to abort the process during shutdown (which turned exit codes into 134). The ranks first
    wait for one another through the store (not a collective, which could pair with a peer's
    unrelated one), at most `EXIT_WAIT_S`; a rank leaving on an uncaught exception does not wait."""
    uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if _broken is not None:
        shown = uncaught is not None and str(uncaught) == _broken  # the CollectiveHang's traceback is above
        logger.error("ds_comm: leaving with exit code %d after a diagnosed hang%s", HUNG_EXIT_CODE,
                     " (see above)" if shown else f":\n{_broken}")
        _flush_and_exit(HUNG_EXIT_CODE)
    if not dist.is_initialized():
        return
    _teardown()
    world = dist.get_world_size()
    if uncaught is None and world > 1:
        try:
            store = dist.distributed_c10d._get_default_store()
            if store.add("ds_comm/exit", 1) >= world:  # the last to arrive: everyone is here
                store.set("ds_comm/exit/all", "1")
            else:
                store.wait(["ds_comm/exit/all"], timedelta(seconds=EXIT_WAIT_S))
        except Exception as e:  # a peer left first (its store is gone) or is still working: leave anyway
            logger.warning("ds_comm: at exit, not every rank arrived within %g s (%s); tearing down alone",
                           EXIT_WAIT_S, str(e).splitlines()[0] if str(e) else type(e).__name__)
    dist.destroy_process_group()


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
    last collective can make that peer abort. A group broken by a diagnosed hang is torn down
    without the barrier (the stuck peer would never come)."""
    if not dist.is_initialized():
        return
    if _broken is None:
        dist.barrier(group=group)
    if group is None:
        _teardown()
    dist.destroy_process_group(group)
