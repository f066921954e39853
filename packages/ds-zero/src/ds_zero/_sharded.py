"""`ShardedParams`: stage 3's partitioned parameters, built in one place for `ZeroOptimizer` (the trained
parameters), `ZeroInference` (every parameter) and `FrozenShards` (a trained model's frozen parameters).

Each runs the same steps: fetch units planned from the model's modules (`plan_units`), a `FlatLayout` of one
bucket per unit, this rank's partition (on the device, or on the host with ``offload_param``), each unit's
shard filled from the whole parameters (those built under `Init` gathered from their shards for it) and
each parameter released, then the `Stage3` hooks that gather a unit around its module's use. The optimizer
builds its master copy and NVMe files between the partition and the fill, so the steps are separate calls:
``ShardedParams(...)`` (plan, layout, partition), `fill`, `attach`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import ds_comm

from ._layout import FlatLayout
from ._model import forget_init_partition, full_shape, gather_init_partitioned, is_init_partitioned
from ._stage3 import Stage3, plan_units
from ._stage3_offload import partition_buffer


def _nothing(*_: Any) -> None:
    return None


class ShardedParams:
    """``params`` of ``model`` partitioned over ``group`` (see the module docstring). ``bucket_size``: the
    layout's (one bucket per unit whatever it is); ``align``: each shard starts at a multiple of it (4 KiB of
    elements for parameters on NVMe); ``stepped_on_host``/``on_disk``: `partition_buffer`'s."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], *, config: Any, group: Any, dtype: torch.dtype,
                 device: torch.device, bucket_size: int = 1, align: int = 1, stepped_on_host: bool | None = None,
                 on_disk: bool = False):
        self.model, self.params, self.config, self.group, self.dtype = model, params, config, group, dtype
        self.device = device  # the model's (the partition: there, or on the host with offload_param)
        self.world_size, self.rank = ds_comm.get_world_size(group), ds_comm.get_rank(group)
        units, self._hooked = plan_units(model, params, config.leaf_module)
        self._unit_names = [name for name, _ in units]
        self.layout = FlatLayout([full_shape(p) for p in params], world_size=self.world_size, bucket_size=bucket_size,
                                 groups=[members for _, members in units], align=align)
        self.shard_starts = self.layout.partition_offsets()
        self.partition = partition_buffer(self.layout.shard_numel, dtype, device, config,
                                          stepped_on_host=stepped_on_host, on_disk=on_disk)
        self.stage3: Stage3 | None = None

    def fill(self, *, master: torch.Tensor | None = None, on_disk: Callable[[int, torch.Tensor], None] | None = None,
             clear_grads: bool = False) -> None:
        """This rank's shard of every unit into the partition, one unit whole at a time; each parameter is
        released after (an empty tensor on the model's device). ``master``: a float32 copy laid out as the
        partition, filled from the 16-bit values (as DeepSpeed's engine casts the model before it takes its
        copy); ``on_disk(start, shard)``: the shards go to NVMe instead (RAM never holds the partition);
        ``clear_grads``: the parameters' ``.grad`` are dropped."""
        for bucket, start in zip(self.layout.buckets, self.shard_starts, strict=True):
            lo, hi = bucket.offset + self.rank * bucket.shard, bucket.offset + (self.rank + 1) * bucket.shard
            shard = torch.zeros(bucket.shard, dtype=self.dtype, device="cpu") if on_disk is not None else \
                self.partition[start:start + bucket.shard]  # (on the host with offload_param)
            for index in bucket.slots:
                slot, p = self.layout.slots[index], self.params[index]
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                # every rank takes part in the gather of a parameter built under Init, holding a piece or not
                whole = gather_init_partitioned(p, self.group) if is_init_partitioned(p) else p.detach()
                if a >= b:
                    continue
                source = whole.reshape(-1)[a - slot.offset:b - slot.offset]
                shard[a - lo:b - lo].copy_(source)
                if master is not None:
                    master[start + a - lo:start + b - lo].copy_(source.to(self.dtype))
                if clear_grads:
                    p.grad = None
            if on_disk is not None:
                on_disk(start, shard)
            for index in bucket.slots:  # released: an empty tensor on the model's device
                self.params[index].data = torch.empty(0, dtype=self.dtype, device=self.device)
                forget_init_partition(self.params[index])

    def attach(self, *, on_modified: Callable[[int, torch.Tensor], None] | None = None, shards: Any = None,
               stage3_class: type[Stage3] = Stage3, gatherer: Any = None) -> Stage3:
        """The `Stage3` hooks over the filled partition (``shards``: where the shards are read and written when
        not in the partition: NVMe; ``on_modified``: a unit's shard changed under `GatheredParameters`;
        ``gatherer``: how units are gathered, `_zeropp.UnitGathers`, exact by default)."""
        self.stage3 = stage3_class(self.model, self.params, self.layout, self._unit_names, self._hooked,
                                   self.partition, self.shard_starts, self.config, self.group,
                                   on_modified or _nothing, shards=shards, gatherer=gatherer)
        for unit in self.stage3.units:  # DeepSpeed's flag: whole on every rank throughout training
            for p in unit.params:
                p.ds_persist = unit.persistent
        return self.stage3

    def whole(self) -> dict[int, torch.Tensor]:
        """Every parameter's whole value, a copy (a collective: one unit gathered at a time)."""
        out: dict[int, torch.Tensor] = {}
        for unit in self.stage3.units:
            self.stage3.hold(unit)
            out.update({id(p): p.detach().clone() for p in unit.params})
            self.stage3.unhold(unit, None)
        return out

    def load_whole(self, values: dict[int, torch.Tensor]) -> None:
        """Set parameters from whole values (``{id(parameter): value}``, the same on every rank): this rank's
        shards are written, and units gathered now take the new values."""
        for unit in self.stage3.units:
            lo = unit.bucket.offset + self.rank * unit.bucket.shard
            start = self.shard_starts[unit.index]
            store = self.stage3.shards  # (NVMe's or MixZ++'s shards: read, written again below)
            if store is None:
                shard = self.partition[start:start + unit.bucket.shard]
            else:
                read, shard = store.start_read_params(start, unit.bucket.shard)
                read.wait()
            for p, shape, offset in zip(unit.params, unit.shapes, unit.offsets, strict=True):
                if id(p) not in values:
                    continue
                flat = values[id(p)].reshape(-1)
                begin = unit.bucket.offset + offset
                a, b = max(lo, begin), min(lo + unit.bucket.shard, begin + shape.numel())
                if a < b:
                    shard[a - lo:b - lo].copy_(flat[a - begin:b - begin])
            if store is not None:
                store.write_params(start, shard)
        self.stage3.after_step()


def full_state_dict(model: nn.Module, sharded: list[Stage3 | None], keep: bool) -> dict[str, torch.Tensor]:
    """``model``'s ``state_dict()`` with every parameter whole, as copies; the units of ``sharded`` are gathered
    one at a time (a collective: every rank calls it). Not ``keep``: ``{}`` (the rank takes part only)."""
    whole: dict[int, torch.Tensor] = {}
    for stage3 in sharded:
        for unit in stage3.units if stage3 is not None else ():
            stage3.hold(unit)
            if keep:
                whole.update({id(p): p.detach().clone() for p in unit.params})
            stage3.unhold(unit, None)
    if not keep:
        return {}
    return {name: whole[id(t)] if id(t) in whole else t.detach().clone()
            for name, t in model.state_dict(keep_vars=True).items()}
