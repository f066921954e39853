"""Checks and small helpers about the model that `ZeroOptimizer` wraps."""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

import torch
from torch import nn

import ds_comm

from ._params import stage3_owner


def version() -> str:
    from . import __version__

    return __version__


def trainable(model: nn.Module) -> list[nn.Parameter]:
    seen, params = set(), []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    if not params:
        raise ValueError("ZeroOptimizer: the model has no parameter that requires a gradient")
    return params


def param_name(model: nn.Module, param: torch.Tensor) -> str:
    return next((name for name, p in model.named_parameters() if p is param), f"<parameter {tuple(param.shape)}>")


def model_device(model: nn.Module, params: list[nn.Parameter]) -> torch.device:
    """The one device every trainable parameter is on (the CPU or one accelerator); a ValueError naming two
    parameters on different devices otherwise."""
    first = params[0]
    for p in params[1:]:
        if p.device != first.device:
            raise ValueError(f"ZeroOptimizer: the trainable parameters must be on one device, but "
                             f"{param_name(model, first)} is on {first.device} and {param_name(model, p)} on "
                             f"{p.device}; move the model with model.to(device) first")
    return first.device


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_same_model(model: nn.Module, params: list[nn.Parameter], group: Any, world_size: int,
                     device: torch.device | str = "cpu") -> None:
    """Every rank must lay out the same parameters: compare a fingerprint of their names, shapes and
    dtypes (one small all-gather, on ``device``: the model's, where its backend communicates) and name
    the first difference on every rank, instead of hanging in a collective of mismatched sizes later."""
    names = {id(p): name for name, p in model.named_parameters()}
    described = [(names.get(id(p), "?"), tuple(full_shape(p)), str(p.dtype)) for p in params]
    digest = hashlib.sha256(repr(described).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64, device=device)
    everyone = torch.zeros(world_size, dtype=torch.int64, device=device)
    ds_comm.all_gather_into_tensor(everyone, mine, group=group)
    if bool((everyone == everyone[0]).all()):
        return
    lists: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(lists, described, group=group)
    for rank, other in enumerate(lists):
        if other != lists[0]:
            first = next((i for i, (a, b) in enumerate(zip(lists[0], other, strict=False)) if a != b),
                         min(len(lists[0]), len(other)))
            theirs = other[first] if first < len(other) else "nothing"
            ours = lists[0][first] if first < len(lists[0]) else "nothing"
            raise ValueError(f"ZeroOptimizer: the ranks' models differ: parameter {first} is {ours} on rank 0 "
                             f"and {theirs} on rank {rank} ({len(lists[0])} vs {len(other)} trainable parameters)")


def broadcast_from_first_rank(model: nn.Module, group: Any, skip: set[int] = frozenset()) -> None:
    """Start from rank 0's parameters and buffers, as DDP does (but those whose id is in ``skip``)."""
    source = ds_comm.get_global_rank(group, 0) if group is not None else 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if is_init_partitioned(tensor) or id(tensor) in skip:  # Init broadcast it when it was built
            continue
        ds_comm.broadcast(tensor.data, src=source, group=group)


# ---- parameters partitioned by `Init` (each rank holds one even slice of the flattened parameter) ----

def is_init_partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_init_shard")


def full_shape(p: torch.Tensor) -> torch.Size:
    """A parameter's whole shape, also while `Init` or stage 3 keeps only a shard of it."""
    return p.ds_shape if hasattr(p, "ds_shape") and (is_init_partitioned(p) or stage3_owner(p) is not None) else p.shape


def init_shard(p: torch.Tensor) -> torch.Tensor:
    """The slice `Init` kept of ``p`` (``p.ds_tensor``, as DeepSpeed's; ``p`` itself is empty), or read
    back from NVMe (``remote_device="nvme"``)."""
    store = getattr(p, "ds_init_store", None)
    return p.ds_tensor if store is None else store.read(p)


def gather_init_partitioned(p: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The whole value of a parameter `Init` partitioned (a collective over its group)."""
    group = getattr(p, "ds_init_group", group)
    world = ds_comm.get_world_size(group)
    # p cast since (model.half()): its shard follows; a shard kept on the host (remote_device "cpu") is
    # gathered on the parameter's device, where the collective's backend (NCCL) can reach it
    shard = init_shard(p).reshape(-1).to(device=p.device, dtype=p.dtype)
    full = torch.empty(shard.numel() * world, dtype=p.dtype, device=p.device)
    ds_comm.all_gather_bucket(full, shard, group=group)
    return full[:p.ds_numel].view(p.ds_shape)


def unpartition(p: torch.Tensor) -> None:
    """Make a parameter `Init` partitioned whole again (a collective)."""
    p.data = gather_init_partitioned(p).clone()
    forget_init_partition(p)


def forget_init_partition(p: torch.Tensor) -> None:
    store = getattr(p, "ds_init_store", None)
    if store is not None:  # its slice's file on NVMe
        store.release(p)
    for key in ("ds_init_shard", "ds_init_group", "ds_shape", "ds_numel", "ds_init_store", "ds_init_key",
                "ds_tensor", "ds_status", "ds_persist"):
        if hasattr(p, key):
            delattr(p, key)


def checked_renames(model: nn.Module, renames: dict[str, str] | None) -> dict[str, str]:
    """``ZeroOptimizer(checkpoint_names=)``: names of the model's parameters and buffers to other, non-empty
    names that leave every tensor's name in checkpoints its own."""
    renames = dict(renames or {})
    names = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    unknown = sorted(k for k in renames if k not in names)
    if unknown or not all(isinstance(v, str) and v for v in renames.values()):
        raise ValueError(f"ZeroOptimizer: checkpoint_names maps parameter and buffer names of the model to non-empty "
                         f"names; got {renames!r}"
                         + (f" (not parameters of the model: {unknown}, nor buffers)" if unknown else ""))
    final = Counter(renames.get(name, name) for name in names)
    clashes = sorted(name for name, count in final.items() if count > 1)
    if clashes:
        raise ValueError(f"ZeroOptimizer: checkpoint_names gives names another parameter has: {clashes} (parameters "
                         "and buffers each need a name of their own)")
    return renames
