"""Parameters replicated over a subgroup of ZeRO's data-parallel group: a parameter group's
``process_group`` key (a Mixture-of-Experts expert lives on the ranks of its expert-data-parallel group
only; ds-zero knows nothing of experts, only of the ranks holding a parameter).

Such a parameter's gradients are reduced over its group only and averaged by ZeRO's data-parallel world
size, not the group's (DeepSpeed's arithmetic for expert gradients, so the result does not depend on how
many groups there are); at stages 1-2 its buckets are split over its group (`FlatLayout`'s ``holders``).
The ranks of different groups hold different tensors by design: the model check and the broadcast of
the initial values run within each group. A group whose ranks are ZeRO's own is ZeRO's group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ds_comm

from ._groups import option_groups
from ._model import (
    broadcast_from_first_rank,
    check_same_model,
    is_init_partitioned,
    trainable,
    unpartition,
    version,
)

KEY = "process_group"
# keys of a parameter group that describe how the run groups its parameters, not the optimizer's options
# (DeepSpeed's MoE marks: ``moe``, and ``name``, the expert-data-parallel group's): a checkpoint loaded at
# another grouping (``ep_size_2`` saved, ``ep_size_1`` loading) restores the options and keeps these
GROUPING_MARKS = ("moe", "name")


def _ranks(pg: Any) -> list[int]:
    """The world ranks of ``pg`` in its own rank order (None: the world)."""
    return list(range(dist.get_world_size())) if pg is None else dist.get_process_group_ranks(pg)


def split_process_groups(options: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]] | None, list[Any]]:
    """The groups' options without ``process_group`` (the torch optimizer gets the rest: DeepSpeed's MoE
    marks ``moe`` and ``name`` are harmless extra keys) and each group's process group (None: ZeRO's)."""
    if options is None:
        return None, [None]
    return [{k: v for k, v in o.items() if k != KEY} for o in options], [o.get(KEY) for o in options]


def replica_holders(process_groups: list[Any], group_of: list[int], group: Any
                    ) -> tuple[list[tuple[int, ...] | None], dict[tuple[int, ...], Any]]:
    """Each parameter's holders for `FlatLayout` (ZeRO ranks in its group's rank order; None: all of ZeRO's
    group) and the process group of each holders tuple. A group must hold this rank and lie inside ZeRO's."""
    zero_ranks = _ranks(group)
    me = dist.get_rank()
    per_group: list[tuple[int, ...] | None] = []
    groups: dict[tuple[int, ...], Any] = {}
    for g, pg in enumerate(process_groups):
        if pg is None or pg is group:
            per_group.append(None)
            continue
        if pg is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(f"ZeroOptimizer: param_groups[{g}]['{KEY}'] does not contain this rank ({me}): "
                             "torch.distributed.new_group returns a placeholder on the ranks outside the group; "
                             "give each rank the group its parameters are replicated over")
        if not isinstance(pg, dist.ProcessGroup):
            raise ValueError(f"ZeroOptimizer: param_groups[{g}]['{KEY}'] must be a torch.distributed process group "
                             f"(or None: ZeRO's group), got {type(pg).__name__}")
        ranks = _ranks(pg)
        if me not in ranks:
            raise ValueError(f"ZeroOptimizer: param_groups[{g}]['{KEY}'] holds ranks {ranks}, not this rank ({me}): "
                             "a parameter group's process group must contain the ranks holding its parameters")
        outside = [r for r in ranks if r not in zero_ranks]
        if outside:
            raise ValueError(f"ZeroOptimizer: param_groups[{g}]['{KEY}'] holds ranks {ranks}, of which {outside} are "
                             f"not in ZeRO's data-parallel group (ranks {zero_ranks}): it must be a subgroup of it")
        if ranks == zero_ranks:
            per_group.append(None)
            continue
        holders = tuple(zero_ranks.index(r) for r in ranks)
        per_group.append(holders)
        groups.setdefault(holders, pg)
    return [per_group[g] for g in group_of], groups


def refuse_replicas(what: str) -> None:
    raise NotImplementedError(f"ZeroOptimizer: param_groups with a '{KEY}' (parameters replicated over a subgroup "
                              f"of the data-parallel group, e.g. MoE experts) are not implemented with {what} in "
                              f"ds-zero {version()}; use zero_optimization.stage 0, 1 or 2 without it")


def check_and_broadcast(model: nn.Module, params: list[nn.Parameter], holders: list[tuple[int, ...] | None],
                        groups: dict[tuple[int, ...], Any], group: Any, world_size: int,
                        device: torch.device) -> None:
    """Every rank of ZeRO's group lays out the same shared parameters, and every rank of a subgroup the same
    parameters of it; each starts from its group's first rank's values (buffers: ZeRO's first rank's)."""
    shared = [p for p, h in zip(params, holders, strict=True) if h is None]
    check_same_model(model, shared, group, world_size, device)
    for key in sorted(groups):  # one order on every rank: no two ranks wait on each other's groups
        members = [p for p, h in zip(params, holders, strict=True) if h == key]
        check_same_model(model, members, groups[key], len(key), device)
    replicated = {id(p) for p, h in zip(params, holders, strict=True) if h is not None}
    broadcast_from_first_rank(model, group, skip=replicated)
    for key in sorted(groups):
        source = ds_comm.get_global_rank(groups[key], 0)
        for p, h in zip(params, holders, strict=True):
            if h == key:
                ds_comm.broadcast(p.data, src=source, group=groups[key])


def check_model_parallel(tensor_parallel_rank: Any, averaging_size: Any, model_parallel_group: Any,
                         world_size: int) -> tuple[int, int]:
    """`ZeroOptimizer`'s ``tensor_parallel_rank`` and ``gradient_averaging_size`` checked: the rank an integer
    >= 0 (above 0 only with a ``model_parallel_group``, whose norm adds what rank 0 counts), the size an
    integer >= 1 (None: the group's ``world_size``)."""
    if isinstance(tensor_parallel_rank, bool) or not isinstance(tensor_parallel_rank, int) or tensor_parallel_rank < 0:
        raise ValueError(f"ZeroOptimizer: tensor_parallel_rank must be an integer >= 0, got {tensor_parallel_rank!r}")
    if tensor_parallel_rank > 0 and model_parallel_group is None:
        raise ValueError(f"ZeroOptimizer: tensor_parallel_rank {tensor_parallel_rank} needs the model_parallel_group "
                         "holding the other tensor-parallel ranks (their replicated parameters count on rank 0 only)")
    if averaging_size is None:
        return tensor_parallel_rank, world_size
    if isinstance(averaging_size, bool) or not isinstance(averaging_size, int) or averaging_size < 1:
        raise ValueError(f"ZeroOptimizer: gradient_averaging_size must be an integer >= 1 or None, got "
                         f"{averaging_size!r}")
    return tensor_parallel_rank, averaging_size


def trained_params(model: nn.Module, param_groups: Any, policy: Any
                   ) -> tuple[list[nn.Parameter], list[int], list[dict[str, Any]] | None, list[Any]]:
    """The parameters ZeRO trains (``model``'s trainable ones, less those in none of ``param_groups``), each
    one's group, the groups' options less their ``process_group`` and the process groups named (`option_groups`,
    `split_process_groups`); ``policy`` (a `ZeroPolicy`) refuses what it cannot train."""
    params = trainable(model)
    group_of, group_options = option_groups(param_groups, model, params)
    if None in group_of:  # in no group: not optimized, held as a frozen parameter is
        params = [p for p, g in zip(params, group_of, strict=True) if g is not None]
        group_of = [g for g in group_of if g is not None]
    group_options, process_groups = split_process_groups(group_options)
    policy.check_params(model, params)
    return params, group_of, group_options, process_groups


def adopt_model(model: nn.Module, params: list[nn.Parameter], policy: Any, process_groups: list[Any],
                group_of: list[int], group: Any, world_size: int, device: torch.device
                ) -> tuple[list[tuple[int, ...] | None], dict[tuple[int, ...], Any]]:
    """The model checked to be the same on every rank (within each replica group) and broadcast from the
    first, and parameters built under ``Init`` made whole again where ZeRO does not partition them (all but
    stage 3's trained and frozen ones); returns each parameter's holders and the replica groups."""
    holders, replica_groups = replica_holders(process_groups, group_of, group)
    if replica_groups:
        policy.check_replicas(refuse_replicas)
        check_and_broadcast(model, params, holders, replica_groups, group, world_size, device)
    else:
        check_same_model(model, params, group, world_size, device)
        broadcast_from_first_rank(model, group)
    managed = {id(p) for p in params}
    for p in model.parameters():  # built under Init: whole again, but stage 3's trainable and frozen ones
        if is_init_partitioned(p) and (not policy.shard_params or (id(p) not in managed and p.requires_grad)):
            unpartition(p)
    return holders, replica_groups
