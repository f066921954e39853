"""ZeRO stage 3: each rank keeps one shard of every parameter; modules gather theirs to run.

The model's trainable parameters are grouped into *units*: the parameters of the first module on each
path from the root that owns a parameter directly, with everything below it (so ``nn.Linear`` is a
unit, and ``nn.MultiheadAttention``, whose forward reads its ``out_proj`` child's weight without
calling it, is one unit with that child). A unit is one bucket of `FlatLayout`: its parameters
flattened end to end and padded into ``world_size`` equal shards; rank r's shard lives in the
optimizer's flat partition, so the optimizer steps it where it is.

* **Forward**: a module's pre-hook gathers its units (one in-place all-gather each) and points the
  parameters at the gathered buffer; its post-hook releases them (the parameters become empty),
  except persistent units (smaller than ``stage3_param_persistence_threshold``, whole on every rank
  all the time) and units used again within ``stage3_max_reuse_distance`` elements.
* **Backward**: autograd's saved tensors that are views of a gathered buffer (a linear layer's
  ``weight.t()``) are saved as a reference to the unit instead (`saved_tensors_hooks`), so releasing
  frees the memory; unpacking gathers the unit again. Its gradients are reduce-scattered into the
  partition as at stage 2, and the unit is released once they are.
* **Prefetch**: the order of requests is recorded in the first forward and backward; while a step
  follows it, the units next in line are gathered ahead (``stage3_prefetch_bucket_size`` elements at
  most, ``stage3_max_live_parameters`` gathered at most). A step that takes another path falls back
  to gathering on demand and records the new order.
* **A parameter read in another module's forward** (a tied LM head's ``F.linear(h, embed.weight)``):
  each module's ``_parameters`` is a dict that gathers a partitioned parameter read during a forward
  and makes it an external parameter of the module running (`fetch_external`), as DeepSpeed's.
* **Devices**: the gather buffers (and the empty tensors of released parameters) are on the model's
  device, where the all-gathers run; the partition is there too, or on the host with
  ``offload_param`` (`_stage3_offload`: each gather copies the shard up first, prefetches ahead on a
  side stream).
* **Same path on every rank** (`PathGuard`, `_stage3_guard`): ranks that call different modules fail at once,
  naming them, instead of issuing collectives of different sizes that hang or mix data."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import ds_comm

from ._layout import Bucket, FlatLayout
from ._params import (
    ZeroParamStatus,
    forget,
    give_id,
    install,
    mark_stage3,
    set_shard,
    stage3_owner,
    uninstall,
    unmark_stage3,
)
from ._pool import GatherPool
from ._stage3_guard import END_OF_BACKWARD, END_OF_FORWARD, PathGuard
from ._stage3_offload import ShardMover, offload_param_device
from ._units import plan_units, tensors_in  # noqa: F401  (plan_units: imported from here)
from ._zeropp import UnitGathers

logger = logging.getLogger(__name__)
EXTERNAL = "_ds_external_parameters"  # a module's attribute: parameters it reads from other modules


@dataclass(eq=False)
class Unit:
    """One fetch unit: a bucket of the layout and the parameters in it."""

    index: int
    name: str
    bucket: Bucket
    params: list[nn.Parameter]
    shapes: list[torch.Size]
    offsets: list[int]  # each parameter's first element in the gathered buffer
    persistent: bool = False
    full: torch.Tensor | None = None  # the gathered buffer (bucket.padded elements)
    work: Any = None  # its all-gather, while in flight
    pointed: bool = False  # the parameters are views of ``full``
    held: int = 0  # GatheredParameters contexts that hold it gathered
    users: int = 0  # modules whose forward is running and uses it (a tied weight: two at once)

    @property
    def numel(self) -> int:
        return self.bucket.numel


@dataclass(frozen=True)
class _Saved:
    """What autograd keeps for a saved view of a gathered buffer: where it was, not the memory."""

    unit: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class Stage3:
    """Gathers, releases and prefetches a model's units for `ZeroOptimizer` at stage 3."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], layout: FlatLayout, unit_names: list[str],
                 hooked: list[tuple[nn.Module, list[int]]], partition: torch.Tensor, shard_starts: list[int],
                 config: Any, group: Any, on_modified: Callable[[int], None], shards: Any = None, gatherer: Any = None):
        self.model, self.layout, self.group, self.partition = model, layout, group, partition
        self.gatherer = gatherer if gatherer is not None else UnitGathers(group)  # exact, or ZeRO++'s (`_zeropp`)
        self.world_size, self.rank = ds_comm.get_world_size(group), ds_comm.get_rank(group)
        self.shard_starts, self.dtype, self.on_modified = shard_starts, partition.dtype, on_modified
        # the model's device: where its released parameters' empty tensors are (the partition may be on the host)
        self.device = next((p.device for p in params if not p.is_meta), partition.device)
        self.units: list[Unit] = []
        for bucket, name in zip(layout.buckets, unit_names, strict=True):
            slots = [layout.slots[i] for i in bucket.slots]
            self.units.append(Unit(bucket.index, name, bucket, [params[i] for i in bucket.slots],
                                   [s.shape for s in slots], [s.offset - bucket.offset for s in slots]))
        self.prefetch_bucket_size = int(config.prefetch_bucket_size)
        self.max_live = int(config.max_live_parameters)
        self.max_reuse_distance = int(config.max_reuse_distance)
        persistent_budget = int(config.model_persistence_threshold)
        for unit in self.units:  # small units stay whole (LayerNorms, biases), up to the model-wide budget
            if unit.numel < config.param_persistence_threshold and unit.bucket.padded <= persistent_budget:
                unit.persistent = True
                persistent_budget -= unit.bucket.padded
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self._by_storage: dict[int, Unit] = {}
        self._trace: list[int] | None = None  # the requests of the last forward+backward (2 * unit + backward)
        self._recording: list[int] = []
        self._position: int | None = 0  # where this step is in the trace (None: off the trace)
        self._ahead: set[int] = set()  # units gathered ahead of their request
        self._in_backward: set[int] = set()  # units requested in this backward
        self._saved_hooks: list[Any] = []
        self.shards: Any = shards  # where this rank's shards are read and written when not in `partition` (NVMe)
        # offload_param (cpu/nvme): shards on the host, copied up to the device before each gather
        self.mover = ShardMover(self.device, shards is not None or offload_param_device(config) != "none")
        self.transfers = self.mover.counts  # host <-> device copies and bytes (tests, benchmarks)
        self._reads: dict[int, Any] = {}  # shard reads started for announced prefetches
        self._staged: dict[int, tuple[torch.Tensor, Any]] = {}  # prefetched units' buffers with their copy up
        self.pool = GatherPool(self.dtype, self.device)  # released gather buffers, for reuse
        self._pending: tuple[Any, list[int]] | None = None  # a check in flight and the prefetches (codes) it announces
        self.gathers = 0  # all-gathers issued (for tests and the benchmark)
        self._hooks: list[Any] = []
        self._names = {unit.index: unit.name for unit in self.units}
        self.guard = PathGuard(group, self._names, host=self.device.type == "cpu")  # waits block on the host
        self._check_group = self.guard.group
        owners = self._owners()
        for p, (unit, k) in owners.items():
            p.ds_shape, p.ds_numel = unit.shapes[k], unit.shapes[k].numel()
            mark_stage3(p, self, unit.index)
            give_id(p)
            self._set_shard(p, unit, k)
            p.ds_persist = unit.persistent  # DeepSpeed's flag: whole on every rank throughout
        self._stack: list[nn.Module] = []  # the modules whose forward is running, innermost last
        self._modules = [m for m in model.modules() if any(p in owners for p in m.parameters(recurse=False))]
        install(self._modules)  # reading a parameter in another module's forward gathers it (`fetch_external`)
        for module, units in hooked:
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward(units)))
            self._hooks.append(module.register_forward_hook(self._post_forward(units), always_call=True))
        holders = {id(module) for module, _ in hooked}
        for module in model.modules():  # the others too (the root's starts a forward): the running module is known
            if id(module) not in holders:
                self._hooks.append(module.register_forward_pre_hook(self._pre_forward([])))
                self._hooks.append(module.register_forward_hook(self._post_forward([]), always_call=True))
        self._root = model
        for unit in self.units:
            if unit.persistent:
                self._gather(unit)
                self._point(unit)
            else:
                self._release_params(unit)

    def _owners(self) -> dict[nn.Parameter, tuple[Unit, int]]:
        return {p: (unit, k) for unit in self.units for k, p in enumerate(unit.params)}

    def _set_shard(self, p: nn.Parameter, unit: Unit, k: int) -> None:
        """``p.ds_tensor``: the elements of ``p`` in this rank's shard of ``unit``, a view of the partition
        (an empty placeholder of that many elements when the shards are on NVMe)."""
        lo = self.rank * unit.bucket.shard
        first = max(lo, unit.offsets[k])
        last = min(lo + unit.bucket.shard, unit.offsets[k] + unit.shapes[k].numel())
        start, count = self.shard_starts[unit.index] + first - lo, max(0, last - first)
        if self.shards is None:
            set_shard(p, self.partition[start:start + count])
        else:
            set_shard(p, torch.empty(0, dtype=self.dtype, device="cpu"), count)
            p.ds_tensor.final_location = getattr(self.shards, "location", "nvme")

    def fetch_external(self, p: nn.Parameter) -> None:
        """``p`` was read while a forward runs (`GatheringParameters`), outside its own module's forward
        when it is not whole: as DeepSpeed, it becomes an external parameter of the running module
        (gathered by it from now on) and is gathered now, to be released with that module."""
        unit = self.units[stage3_owner(p)[1]]
        if not self._stack or unit.pointed:
            return
        module = self._stack[-1]
        external = module.__dict__.setdefault(EXTERNAL, [])
        if not any(q is p for q in external):
            external.append(p)
        self.request(unit, "forward")
        unit.users += 1

    # ------------------------------------------------------------------------------------ hooks
    def _pre_forward(self, units: list[int]):
        def hook(module, args):
            if module is self._root:
                self._begin_forward()
            self._stack.append(module)
            for u in [*units, *self._external_units(module)]:
                if not self.units[u].persistent:
                    self.request(self.units[u], "forward")
                    self.units[u].users += 1
        return hook

    def _post_forward(self, units: list[int]):
        def hook(module, args, output):
            if module in self._stack:
                del self._stack[len(self._stack) - 1 - self._stack[::-1].index(module)]
            used = [u for u in [*units, *self._external_units(module)] if not self.units[u].persistent]
            for u in used:
                self.units[u].users = max(0, self.units[u].users - 1)
                self._after_use(self.units[u])
            if used and torch.is_grad_enabled():  # gather them again when backward reaches this module
                for tensor in tensors_in(output):
                    if tensor.requires_grad:
                        tensor.register_hook(self._pre_backward(used))
            if module is self._root:  # no collective when the forward raised (this hook is always called)
                self._end_forward(check=sys.exc_info()[0] is None)
        return hook

    def _pre_backward(self, units: list[int]):
        def hook(grad):
            for u in units:
                self.backward_request(self.units[u])
        return hook

    def backward_request(self, unit: Unit) -> None:
        """Backward needs ``unit``'s parameters (once per backward, unless released meanwhile)."""
        if unit.index not in self._in_backward or unit.full is None:
            self._in_backward.add(unit.index)
            self.request(unit, "backward")

    def _external_units(self, module: nn.Module) -> list[int]:
        owners = [stage3_owner(p) for p in getattr(module, EXTERNAL, ())]
        return [owner[1] for owner in owners if owner is not None and owner[0] is self]

    def _begin_forward(self) -> None:
        if self._saved_hooks:  # a forward that raised left its hooks on
            self._end_forward(check=False)
        if torch.is_grad_enabled():
            hooks = torch.autograd.graph.saved_tensors_hooks(self.pack_saved, self.unpack_saved)
            hooks.__enter__()
            self._saved_hooks.append(hooks)
        if self._recording and not self._in_backward:  # the last forward had no backward (evaluation)
            self._restart()

    def _end_forward(self, check: bool = True) -> None:
        for unit in self.units:  # a forward that raised leaves users counted
            unit.users = 0
        self._stack.clear()
        while self._saved_hooks:
            self._saved_hooks.pop().__exit__(None, None, None)
        if check:
            self._flush()
            self.guard.end(END_OF_FORWARD)
        else:
            self.guard.abandon()

    def pack_saved(self, tensor: torch.Tensor) -> Any:
        """Autograd's saved-tensor pack hook (a frozen-parameter `Stage3` of the same model chains to it)."""
        if not self._by_storage or tensor.layout != torch.strided:
            return tensor
        unit = self._by_storage.get(tensor.untyped_storage().data_ptr())
        if unit is None:
            return tensor
        return _Saved(unit.index, tensor.size(), tensor.stride(), tensor.storage_offset())

    def unpack_saved(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        unit = self.units[saved.unit]
        self.backward_request(unit)
        return unit.full.as_strided(saved.size, saved.stride, saved.offset)

    # ---------------------------------------------------------------------------- fetch/release
    def request(self, unit: Unit, phase: str) -> None:
        """Make ``unit`` whole here: gather it (or wait for its prefetch), point its parameters at it,
        and decide what to prefetch. No gather is issued before every rank has said it issues the
        same (`PathGuard`): an on-demand gather checks at once; prefetches are announced with a check
        that runs while this module computes and are issued at the next request (`_flush`), so a
        step that follows its trace waits for no other rank at module boundaries."""
        self._flush()
        code = 2 * unit.index + (phase == "backward")
        self._recording.append(code)
        self.guard.requested(code)
        on_trace = False
        if self._position is not None and self._trace is not None:
            if self._position < len(self._trace) and self._trace[self._position] == code:
                self._position += 1
                on_trace = True
            else:
                self._position = None
                self._drop_ahead()
        self._ahead.discard(unit.index)
        if unit.full is None:
            self.guard.check(code, [unit.index])
            self._gather(unit, code)
        codes = self._to_prefetch() if on_trace else []  # (each gathered for the phase the trace has it in)
        if codes:
            prefetch = [c // 2 for c in codes]
            self._pending = (self.guard.announce(code, prefetch), codes)
            for u in prefetch:  # NVMe: reads run while the check does and the module computes; host: copies up
                if self.mover.host and self.shards is None:
                    self._stage(self.units[u])
                else:
                    self._reads[u] = self._start_read(self.units[u])
        self._point(unit)

    def _flush(self) -> None:
        """The announced prefetches: wait for their check, then issue them."""
        if self._pending is None:
            return
        check, codes = self._pending
        self._pending = None
        self.guard.confirm(check)
        for c in codes:
            u = c // 2
            if self.units[u].full is None:
                self._gather(self.units[u], c)
                self._ahead.add(u)
            else:  # gathered meanwhile (a tied weight): its read or staged copy is not needed
                self._unstage(u)
                read = self._reads.pop(u, None)
                if read is not None:
                    self._done_with(read, self._shard_of(read))

    def _start_read(self, unit: Unit) -> Any:
        """This rank's shard of ``unit``: a view of the partition, or a read from NVMe started now (into a
        page-locked staging buffer of the mover's)."""
        start, shard = self.shard_starts[unit.index], unit.bucket.shard
        if self.shards is None:
            return self.partition[start:start + shard]
        return self.shards.start_read_params(start, shard, out=self.mover.staging(shard, self.dtype))

    def _done_with(self, read: Any, shard: torch.Tensor) -> None:
        """A read's staging buffer (NVMe) goes back to the mover once the copies from it are issued."""
        if not isinstance(read, torch.Tensor):
            self.mover.done_with(shard)

    def _mine(self, unit: Unit, full: torch.Tensor) -> torch.Tensor:
        """This rank's place in a gather buffer of ``unit``."""
        return full[self.rank * unit.bucket.shard:(self.rank + 1) * unit.bucket.shard]

    def _stage(self, unit: Unit) -> None:
        """A prefetch with the shards on the host: its buffer now, and the copy up issued ahead (side stream)."""
        full = self.pool.take(unit.bucket.padded)
        self._staged[unit.index] = (full, self.mover.stage(self._start_read(unit), self._mine(unit, full)))

    def _unstage(self, index: int) -> None:
        staged = self._staged.pop(index, None)
        if staged is not None:
            self.mover.wait(staged[1])  # (its copy is ordered before the buffer's next use)
            self.pool.give(staged[0])

    @staticmethod
    def _shard_of(read: Any) -> torch.Tensor:
        if isinstance(read, torch.Tensor):
            return read
        request, shard = read
        request.wait()
        return shard

    def _gather(self, unit: Unit, code: int | None = None) -> None:
        """Issue ``unit``'s all-gather on the device: this rank's shard into its place first (copied up
        from the host with offload_param; a staged prefetch's copy is waited for), then in place.
        ``code``: a gather of a forward or backward (ZeRO++'s way, `UnitGathers`), which the path guard sees first."""
        phase = None if code is None else ("backward" if code % 2 else "forward")
        if code is not None:
            self.guard.issuing(code, lambda: self.gatherer.scratch(unit.bucket.padded, self.dtype, self.device,
                                                                  unit.index, phase))
        staged = self._staged.pop(unit.index, None)
        if staged is not None:
            unit.full, event = staged
            self.mover.wait(event)
            source = None
        else:
            read = self._reads.pop(unit.index, None)
            read = read if read is not None else self._start_read(unit)
            shard = self._shard_of(read)
            unit.full = self.pool.take(unit.bucket.padded)
            source = self.mover.load(shard, self._mine(unit, unit.full))
            self._done_with(read, shard)
        unit.work = self.gatherer.start(unit.index, unit.full, source, phase)
        self.gathers += 1
        self._status(unit, ZeroParamStatus.INFLIGHT)
        if not unit.persistent:  # views of a persistent unit stay valid: autograd may keep them
            self._by_storage[unit.full.untyped_storage().data_ptr()] = unit

    def _point(self, unit: Unit) -> None:
        if unit.work is not None:
            self.guard.wait(unit.work, unit.index)
            unit.work = None
            self.gatherer.landed(unit.index, unit.full)
        if not unit.pointed:
            for p, shape, offset in zip(unit.params, unit.shapes, unit.offsets, strict=True):
                p.data = unit.full[offset:offset + shape.numel()].view(shape)
            unit.pointed = True
            self._status(unit, ZeroParamStatus.AVAILABLE)

    def _release_params(self, unit: Unit) -> None:
        for p in unit.params:
            p.data = self._empty
        unit.pointed = False
        self._status(unit, ZeroParamStatus.NOT_AVAILABLE)

    @staticmethod
    def _status(unit: Unit, status: ZeroParamStatus) -> None:
        for p in unit.params:
            p.ds_status = status

    def release(self, unit: Unit) -> None:
        """Back to the shard only (a gather still in flight completes first: every rank issued it)."""
        if unit.persistent or unit.held or unit.users or unit.full is None:
            return
        if unit.work is not None:
            self.guard.wait(unit.work, unit.index)
            unit.work = None
        self._by_storage.pop(unit.full.untyped_storage().data_ptr(), None)
        self._release_params(unit)
        full, unit.full = unit.full, None
        self.gatherer.released(unit.index)
        self.pool.give(full)
        self._ahead.discard(unit.index)

    def _after_use(self, unit: Unit) -> None:
        """After a module's forward: release ``unit`` unless the trace says it is used again soon, or
        backward is using it (a forward recomputed by activation checkpointing runs inside backward:
        the unit's gradients are still to come, and their reduction releases it)."""
        if unit.index in self._in_backward and unit.full is not None:
            return
        if not self._reused_soon(unit):
            self.release(unit)

    def _reused_soon(self, unit: Unit) -> bool:
        if self._trace is None or self._position is None or unit.full is None:
            return False
        if self.live_numel() > self.max_live:
            return False
        distance = 0
        for u in (c // 2 for c in self._trace[self._position:]):
            if u == unit.index:
                return True
            distance += self.units[u].numel
            if distance > self.max_reuse_distance:
                return False
        return False

    def live_numel(self) -> int:
        """Elements gathered now (persistent units not counted)."""
        return sum(u.bucket.padded for u in self.units if u.full is not None and not u.persistent)

    def _to_prefetch(self) -> list[int]:
        """The units next in the trace to gather now, as their trace codes: none while more than half of
        ``stage3_prefetch_bucket_size`` is gathered ahead (so refills come in batches: fewer checks),
        else as many as fit in it and in ``stage3_max_live_parameters``."""
        ahead = sum(self.units[u].numel for u in self._ahead)
        if ahead > self.prefetch_bucket_size // 2:
            return []
        live = self.live_numel()
        out: list[int] = []
        for code in self._trace[self._position:]:
            unit = self.units[code // 2]
            if unit.persistent or unit.full is not None or any(c // 2 == unit.index for c in out):
                continue
            if ahead + unit.numel > self.prefetch_bucket_size or live + unit.bucket.padded > self.max_live:
                break
            out.append(code)
            ahead += unit.numel
            live += unit.bucket.padded
        return out

    def _drop_ahead(self) -> None:
        for u in list(self._ahead):
            self.release(self.units[u])
        self._ahead.clear()

    # ------------------------------------------------------------------------------ step events
    def after_reduction(self, bucket: int) -> None:
        """A unit's gradients are reduced: backward needs its parameters no more."""
        self.release(self.units[bucket])

    def after_backward(self) -> None:
        """End of a backward: every rank agrees it ended, every non-persistent unit is released, and
        this step's requests become the trace the next step prefetches by."""
        self._flush()
        self.guard.end(END_OF_BACKWARD)
        for unit in self.units:
            self.release(unit)
        if self._position is None or self._trace is None or self._position != len(self._trace):
            if self._trace is not None:
                logger.debug("ZeRO-3: this step's module order differs from the last; re-recorded")
            self._trace = list(self._recording)
        self._restart()
        self.gatherer.forget()  # (hpZ's secondary copies: the next forward keeps them anew)

    def _restart(self) -> None:
        self._recording = []
        self._position = 0
        self._in_backward.clear()
        self._drop_ahead()

    def after_step(self) -> None:
        """The optimizer updated the shards: persistent (and held) units gather them again."""
        self.gatherer.forget()
        self._regather([unit for unit in self.units if unit.full is not None])

    def _regather(self, units: list[Unit]) -> None:
        """``units`` (gathered, none in flight) gathered again from the shards, exactly."""
        reads = [self._start_read(unit) for unit in units]
        works = []
        for unit, read in zip(units, reads, strict=True):
            shard = self._shard_of(read)
            source = self.mover.load(shard, self._mine(unit, unit.full))
            self._done_with(read, shard)
            works.append(self.gatherer.start(unit.index, unit.full, source, None))
        for work in works:
            work.wait()

    # ------------------------------------------------------------------------- gather for users
    def hold(self, unit: Unit) -> None:
        """Gather ``unit`` and keep it whole until `unhold` (GatheredParameters), with exact values."""
        if unit.full is None:
            self._gather(unit)
        self._point(unit)
        if not self.gatherer.exact(unit.index):  # gathered by qwZ for a module: the shards' values instead
            self._regather([unit])
        unit.held += 1

    def unhold(self, unit: Unit, modifier_rank: int | None) -> None:
        """End a hold: with ``modifier_rank``, its full values go to every rank and into the shards."""
        if modifier_rank is not None:
            source = ds_comm.get_global_rank(self.group, modifier_rank) if self.group is not None else modifier_rank
            ds_comm.broadcast(unit.full, src=source, group=self.group)
            start, shard = self.shard_starts[unit.index], unit.bucket.shard
            mine = self._mine(unit, unit.full)
            if self.shards is None:  # (down to the host with offload_param)
                written = self.partition[start:start + shard]
                self.mover.store(mine, written)
            else:
                written = self.mover.to_host(mine)
                self.shards.write_params(start, written)
            self.on_modified(unit.index, written)
            self.gatherer.forget(unit.index)
        unit.held -= 1
        if not unit.held:
            self.release(unit)

    def gather_all(self) -> None:
        """Every unit whole again, for good (`ZeroOptimizer.close`)."""
        self._flush()
        for unit in self.units:
            if unit.full is None:
                self._gather(unit)
        for unit in self.units:
            self._point(unit)
            unit.persistent = True
        self.close()

    def close(self) -> None:
        self.guard.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._end_forward(check=False)
        for index in list(self._staged):
            self._unstage(index)
        self.pool.clear()
        self.mover.clear()
        for p in (p for unit in self.units for p in unit.params):
            if unmark_stage3(p, self):
                forget(p)  # whole again: no shard, no status (ds_id stays)
        uninstall(self._modules)

    def empty_cache(self) -> None:
        """Release every unit not persistent, held or in use, and drop the pooled gather buffers."""
        self._flush()
        self._drop_ahead()
        for unit in self.units:
            self.release(unit)
        self.pool.clear()
        self.gatherer.forget()

    def held_bytes(self) -> int:
        """Bytes of gathered buffers (persistent and in use)."""
        return sum(u.full.numel() * u.full.element_size() for u in self.units if u.full is not None)

    def pooled_bytes(self) -> int:
        """Bytes of released gather buffers kept for reuse."""
        return self.pool.nbytes()

