"""DeepSpeed's attributes of a ZeRO-3 parameter, and its ``_parameters`` dict that gathers on access.

A partitioned parameter is empty (``numel() == 0``) and carries, as in DeepSpeed:

* ``ds_shape``, ``ds_numel``: its whole shape and element count;
* ``ds_tensor``: this rank's part of it. Under `Init` that is DeepSpeed's shard, ``ceil(ds_numel /
  world)`` elements: rank r's slice of the flattened parameter, zero-padded at the end. Once
  `ZeroOptimizer` or `ZeroInference` took the model it is a view of their flat partition: the elements
  of the parameter in this rank's shard of its module's unit (ds shards a module's parameters
  together), so the optimizer's updates show in it (an empty placeholder with parameters on NVMe,
  where the shard is on disk). ``ds_tensor.ds_numel`` is the shard's element count in every case;
* ``ds_status``: `ZeroParamStatus` (``NOT_AVAILABLE`` partitioned, ``INFLIGHT`` being gathered,
  ``AVAILABLE`` whole here);
* ``ds_id``: a number unique to the parameter in this process, given in creation order;
* ``ds_persist``: whole on every rank throughout (its unit is below ``stage3_param_persistence_threshold``).

Which `Stage3` partitions a parameter (and in which of its units) is ds-zero's own mark, not DeepSpeed's: it
is set, read and dropped only through `mark_stage3`, `stage3_owner` and `unmark_stage3`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from enum import Enum
from typing import Any

import torch
from torch import nn


class ZeroParamStatus(Enum):
    """Where a ZeRO-3 parameter's values are (DeepSpeed's enum, same members and values)."""

    AVAILABLE = 1  # whole on this rank
    NOT_AVAILABLE = 2  # partitioned: this rank holds its shard only
    INFLIGHT = 3  # being gathered


_ids = itertools.count()
_STAGE3 = "_ds_stage3"  # the mark: (the Stage3 partitioning the parameter, the index of its unit there)


def stage3_owner(p: torch.Tensor) -> tuple[Any, int] | None:
    """The `Stage3` partitioning ``p`` and the index of ``p``'s unit in it, or None."""
    return getattr(p, _STAGE3, None)


def mark_stage3(p: torch.Tensor, owner: Any, unit_index: int) -> None:
    """``owner`` (a `Stage3`) partitions ``p``, in its unit ``unit_index``."""
    setattr(p, _STAGE3, (owner, unit_index))


def units_of(params: Iterable[torch.Tensor]) -> dict[Any, list[Any]]:
    """The stage-3 units holding ``params``, by owner (the `Stage3` that marked them)."""
    out: dict[Any, list[Any]] = {}
    for p in params:
        owner = stage3_owner(p)
        if owner is not None:
            stage3, index = owner
            units = out.setdefault(stage3, [])
            if stage3.units[index] not in units:
                units.append(stage3.units[index])
    return out


def unmark_stage3(p: torch.Tensor, owner: Any) -> bool:
    """``owner`` partitions ``p`` no more: the mark goes if ``owner`` set it. Whether it did."""
    mark = getattr(p, _STAGE3, None)
    if mark is None or mark[0] is not owner:
        return False
    delattr(p, _STAGE3)
    return True


def give_id(p: torch.Tensor) -> None:
    """``p.ds_id``, once: the next number of this process."""
    if not hasattr(p, "ds_id"):
        p.ds_id = next(_ids)


def set_shard(p: torch.Tensor, shard: torch.Tensor, numel: int | None = None) -> None:
    """``p.ds_tensor = shard`` with DeepSpeed's ``ds_tensor.ds_numel`` (its elements, or ``numel`` where
    the shard is elsewhere: an empty placeholder for a shard on NVMe)."""
    shard.ds_numel = shard.numel() if numel is None else numel
    p.ds_tensor = shard


def forget(p: torch.Tensor) -> None:
    """``p`` is whole for good: the attributes of a partitioned parameter go (``ds_id`` stays)."""
    for key in ("ds_tensor", "ds_status", "ds_shape", "ds_numel", "ds_persist"):
        if hasattr(p, key):
            delattr(p, key)


class GatheringParameters(dict):
    """A module's ``_parameters`` while stage 3 manages it (DeepSpeed's ``ZeROOrderedDict``): reading a
    partitioned parameter while a forward of its model runs (``self.embed.weight`` in another module's
    forward: a tied LM head) makes it an external parameter of the running module and gathers it, so
    it is whole for that module's forward and released with it (and gathered by that module from then
    on, as `register_external_parameter` would)."""

    def __getitem__(self, key: str) -> Any:
        param = dict.__getitem__(self, key)
        owner = getattr(param, _STAGE3, None) if param is not None else None  # stage3_owner, inline: every read
        if owner is not None:
            owner[0].fetch_external(param)
        return param

    def __reduce__(self):  # a deep copy or pickle of the module gets a plain dict
        return dict, (dict(self),)


def install(modules: list[nn.Module]) -> None:
    for module in modules:
        params = module.__dict__.get("_parameters")
        if isinstance(params, dict) and not isinstance(params, GatheringParameters):
            module.__dict__["_parameters"] = GatheringParameters(params)


def uninstall(modules: list[nn.Module]) -> None:
    """Plain dicts again, where no parameter of the module is managed any more (another `Stage3` of
    the model, over its frozen parameters, may still manage some)."""
    for module in modules:
        params = module.__dict__.get("_parameters")
        if isinstance(params, GatheringParameters) and not any(
                stage3_owner(p) is not None for p in dict.values(params) if p is not None):
            module.__dict__["_parameters"] = dict(params)
