"""DeepSpeed's ``deepspeed.runtime.sequence_parallel.parallel_state_sp``: a module that is an mpu for Ulysses
sequence parallelism alone (pass the module as ``initialize(mpu=...)``).

`initialize_sequence_parallel(P)` makes the sequence-parallel groups (blocks of ``P`` neighbouring ranks) and
the sequence × data parallel group (every rank, as in DeepSpeed, whose groups have only these two axes). The
model-parallel questions are answered with the sequence-parallel ones (DeepSpeed's aliases), and there is no
data-parallel group of its own: an engine given this mpu reads it as sequence-only, as DeepSpeed's does."""

from __future__ import annotations

from typing import Any

import ds_comm

__all__ = ["get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
           "get_sequence_data_parallel_group", "get_sequence_data_parallel_rank",
           "get_sequence_data_parallel_world_size", "get_sequence_parallel_group", "get_sequence_parallel_rank",
           "get_sequence_parallel_world_size", "initialize_sequence_parallel"]

_SEQUENCE_PARALLEL_GROUP: Any = None
_SEQUENCE_DATA_PARALLEL_GROUP: Any = None


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Make the groups (a collective: every rank calls it with the same size)."""
    global _SEQUENCE_PARALLEL_GROUP, _SEQUENCE_DATA_PARALLEL_GROUP
    if not ds_comm.is_initialized():
        raise RuntimeError("initialize_sequence_parallel: no process group yet; call ds_all.comm.init_distributed() "
                           "first")
    size = sequence_parallel_size
    if isinstance(size, bool) or not isinstance(size, int) or size <= 1:
        raise ValueError(f"sequence_parallel_size must be an integer greater than 1, got {size!r}")
    world = ds_comm.get_world_size()
    if world < size or world % size:
        raise ValueError(f"sequence_parallel_size {size} must divide the world size {world}")
    if _SEQUENCE_PARALLEL_GROUP is not None:
        raise RuntimeError("initialize_sequence_parallel: the sequence-parallel groups exist already")
    rank = ds_comm.get_rank()
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group = ds_comm.new_group(ranks)
        if rank in ranks:
            _SEQUENCE_PARALLEL_GROUP = group
    _SEQUENCE_DATA_PARALLEL_GROUP = ds_comm.new_group(list(range(world)))


def _release_sequence_parallel_groups() -> None:
    """Forget the groups (after the process group they belong to is destroyed)."""
    global _SEQUENCE_PARALLEL_GROUP, _SEQUENCE_DATA_PARALLEL_GROUP
    _SEQUENCE_PARALLEL_GROUP = _SEQUENCE_DATA_PARALLEL_GROUP = None


def get_sequence_parallel_group() -> Any:
    if _SEQUENCE_PARALLEL_GROUP is None:
        raise RuntimeError("the sequence-parallel group is not initialized: call initialize_sequence_parallel")
    return _SEQUENCE_PARALLEL_GROUP


def get_sequence_data_parallel_group() -> Any:
    if _SEQUENCE_DATA_PARALLEL_GROUP is None:
        raise RuntimeError("the sequence-data-parallel group is not initialized: call initialize_sequence_parallel")
    return _SEQUENCE_DATA_PARALLEL_GROUP


def get_sequence_parallel_world_size() -> int:
    return ds_comm.get_world_size(get_sequence_parallel_group())


def get_sequence_data_parallel_world_size() -> int:
    return ds_comm.get_world_size(get_sequence_data_parallel_group())


def get_sequence_parallel_rank() -> int:
    return ds_comm.get_rank(get_sequence_parallel_group())


def get_sequence_data_parallel_rank() -> int:
    return ds_comm.get_rank(get_sequence_data_parallel_group())


# one axis besides data: model parallel is sequence parallel (DeepSpeed's aliases)
get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
