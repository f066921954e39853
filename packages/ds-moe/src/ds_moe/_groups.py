"""Expert-parallel and expert-data-parallel process groups, named as DeepSpeed's ``deepspeed.utils.groups``.

A group set is named ``"ep_size_<N>"``. Every rank builds every group (``ds_comm.new_group`` is called by all
ranks in the same order) and keeps the one that holds it. With ``world = 4`` and ``ep_size = 2``:

* default (expert before data): expert-parallel ``[0, 1], [2, 3]``; expert-data-parallel ``[0, 2], [1, 3]``;
* ``use_data_before_expert_parallel_=True``: expert-parallel ``[0, 2], [1, 3]``; expert-data-parallel
  ``[0, 1], [2, 3]``.

With pipeline stages (``pp_size``) the groups are built inside each stage's block of consecutive ranks; with a
model-parallel size ``mp_size > 1`` the stage's ranks are first reordered (``mp_mode="tp"``: tensor-parallel
strided) as DeepSpeed does.
"""

from __future__ import annotations

import logging

import ds_comm

logger = logging.getLogger(__name__)

_EXPERT_PARALLEL_GROUP: dict = {}
_EXPERT_PARALLEL_GROUP_RANKS: dict = {}
_EXPERT_DATA_PARALLEL_GROUP: dict = {}
_EXPERT_DATA_PARALLEL_GROUP_RANKS: dict = {}


def _require_initialized(call: str) -> None:
    if not ds_comm.is_initialized():
        raise RuntimeError(f"ds_moe.groups.{call}: no process group; call ds_comm.init_distributed() first")


def _group_name(expert_parallel_size_: int) -> str:
    return f"ep_size_{expert_parallel_size_}"


def _reset_expert_groups() -> None:
    """Forget every expert group (after the process group is destroyed and made again in one process)."""
    for table in (_EXPERT_PARALLEL_GROUP, _EXPERT_PARALLEL_GROUP_RANKS, _EXPERT_DATA_PARALLEL_GROUP,
                  _EXPERT_DATA_PARALLEL_GROUP_RANKS):
        table.clear()


def _expert_group_ranks(world_size: int, expert_parallel_size_: int, pp_size: int = 1, mp_size: int = 1,
                        mp_mode: str = "tp", use_data_before_expert_parallel_: bool = False
                        ) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel rank lists, expert-data-parallel rank lists) over the whole world, in creation order."""
    for name, value in (("expert_parallel_size_", expert_parallel_size_), ("pp_size", pp_size),
                        ("mp_size", mp_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"ds_moe.groups: {name} must be a positive int, got {value!r}")
    if world_size % pp_size:
        raise ValueError(f"ds_moe.groups: pp_size={pp_size} does not divide the world size {world_size}")
    stride = world_size // pp_size
    if stride % expert_parallel_size_:
        raise ValueError(f"ds_moe.groups: ep_size={expert_parallel_size_} does not divide the world size "
                         f"{world_size}" + (f" per pipeline stage ({stride} ranks, pp_size={pp_size})"
                                            if pp_size > 1 else "")
                         + f"; allowed: a divisor of {stride}")
    ep = expert_parallel_size_
    ep_groups: list[list[int]] = []
    edp_groups: list[list[int]] = []
    if mp_size <= 1:
        ep_stride = stride // ep
        for start in range(0, world_size, stride):
            for i in range(ep):
                if use_data_before_expert_parallel_:
                    edp_groups.append(list(range(start + i * ep_stride, start + (i + 1) * ep_stride)))
                else:
                    edp_groups.append(list(range(start + i, start + stride, ep)))
        if use_data_before_expert_parallel_:
            for start in range(0, world_size, stride):
                for i in range(ep_stride):
                    ep_groups.append(list(range(start + i, start + stride, ep_stride)))
        else:
            for i in range(world_size // ep):
                ep_groups.append(list(range(i * ep, (i + 1) * ep)))
        return ep_groups, edp_groups
    if use_data_before_expert_parallel_:
        raise NotImplementedError("ds_moe.groups: use_data_before_expert_parallel_ with mp_size > 1 is not "
                                  "supported (as in DeepSpeed)")
    if mp_mode not in ("tp", "sp"):
        raise ValueError(f"ds_moe.groups: mp_mode must be 'tp' or 'sp', got {mp_mode!r}")
    if stride % mp_size:
        raise ValueError(f"ds_moe.groups: mp_size={mp_size} does not divide the {stride} ranks of a stage")
    for start in range(0, world_size, stride):
        stage = list(range(start, start + stride))
        if mp_mode == "tp":
            lanes = stride // mp_size
            stage = [stage[g * mp_size + lane] for lane in range(mp_size) for g in range(lanes)]
        parts = [stage[g * ep:(g + 1) * ep] for g in range(stride // ep)]
        ep_groups.extend(parts)
        edp_groups.extend([[part[pos] for part in parts] for pos in range(ep)])
    return ep_groups, edp_groups


def _create_expert_and_data_parallel(expert_parallel_size_, mp_size=None, pp_size=None, mp_mode="tp",
                                     use_data_before_expert_parallel_=False, folding_spec=None) -> None:
    """Create the ``"ep_size_<N>"`` expert-parallel and expert-data-parallel groups (DeepSpeed's
    signature). Every rank must call it, in the same order; groups that exist already are kept."""
    _require_initialized("_create_expert_and_data_parallel")
    if folding_spec is not None:
        raise NotImplementedError("ds_moe.groups: folding_spec (DeepSpeed's AutoEP+AutoTP folding) is not built")
    world = ds_comm.get_world_size()
    rank = ds_comm.get_rank()
    name = _group_name(expert_parallel_size_)
    ep_groups, edp_groups = _expert_group_ranks(world, expert_parallel_size_, 1 if pp_size is None else pp_size,
                                                1 if mp_size is None else mp_size, mp_mode,
                                                use_data_before_expert_parallel_)
    logger.info("creating expert groups %s: expert parallel %s, expert data parallel %s", name, ep_groups,
                edp_groups)
    # DeepSpeed's order: the expert-data-parallel groups first, then the expert-parallel ones.
    for table, ranks_table, rank_lists in ((_EXPERT_DATA_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_GROUP_RANKS,
                                            edp_groups),
                                           (_EXPERT_PARALLEL_GROUP, _EXPERT_PARALLEL_GROUP_RANKS, ep_groups)):
        if name in table:
            continue
        for ranks in rank_lists:
            group = ds_comm.new_group(ranks)
            if rank in ranks:
                table[name] = group
                ranks_table[name] = ranks


def _lookup(table: dict, group_name: str, what: str):
    if group_name not in table:
        raise RuntimeError(f"ds_moe.groups: {what} group {group_name!r} is not initialized (created: "
                           f"{sorted(table)}); call _create_expert_and_data_parallel(<ep_size>) or "
                           "MoE.set_deepspeed_parallelism() first")
    return table[group_name]


def _get_expert_parallel_group(group_name):
    """The expert-parallel group of this rank named ``group_name``."""
    return _lookup(_EXPERT_PARALLEL_GROUP, group_name, "expert parallel")


def _get_expert_parallel_group_ranks(group_name):
    """The global ranks of this rank's expert-parallel group ``group_name``."""
    return _lookup(_EXPERT_PARALLEL_GROUP_RANKS, group_name, "expert parallel")


def _get_expert_parallel_group_dict():
    """{name: this rank's expert-parallel group} (the live table, as DeepSpeed's)."""
    return _EXPERT_PARALLEL_GROUP


def _get_expert_data_parallel_group(group_name):
    """The expert-data-parallel group of this rank named ``group_name``."""
    return _lookup(_EXPERT_DATA_PARALLEL_GROUP, group_name, "expert data parallel")


def _get_expert_data_parallel_group_ranks(group_name):
    """The global ranks of this rank's expert-data-parallel group ``group_name``."""
    return _lookup(_EXPERT_DATA_PARALLEL_GROUP_RANKS, group_name, "expert data parallel")


def _get_expert_data_parallel_group_dict():
    """{name: this rank's expert-data-parallel group} (the live table, as DeepSpeed's)."""
    return _EXPERT_DATA_PARALLEL_GROUP


def _get_max_expert_size():
    """The largest ep_size among the created groups (None if none)."""
    sizes = [int(name.split("_")[2]) for name in _EXPERT_PARALLEL_GROUP]
    return max(sizes) if sizes else None


def _get_max_expert_size_name():
    """``"ep_size_<largest>"``."""
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group():
    """The expert-parallel group with the largest ep_size."""
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_broadcast_src_rank(group_name):
    """Global rank of rank 0 of this rank's expert-data-parallel group."""
    _require_initialized("_get_expert_broadcast_src_rank")
    return ds_comm.get_global_rank(_get_expert_data_parallel_group(group_name), 0)


def _get_expert_parallel_world_size(group_name):
    _require_initialized("_get_expert_parallel_world_size")
    return ds_comm.get_world_size(group=_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_world_size(group_name):
    _require_initialized("_get_expert_data_parallel_world_size")
    return ds_comm.get_world_size(group=_get_expert_data_parallel_group(group_name))


def _get_expert_parallel_rank(group_name):
    _require_initialized("_get_expert_parallel_rank")
    return ds_comm.get_rank(group=_get_expert_parallel_group(group_name))


def _get_expert_parallel_src_rank(group_name):
    """DeepSpeed's arithmetic: ``(global rank // ep world size) * ep world size``."""
    _require_initialized("_get_expert_parallel_src_rank")
    size = _get_expert_parallel_world_size(group_name)
    return (ds_comm.get_rank() // size) * size


def _get_expert_data_parallel_rank(group_name):
    _require_initialized("_get_expert_data_parallel_rank")
    return ds_comm.get_rank(group=_get_expert_data_parallel_group(group_name))
