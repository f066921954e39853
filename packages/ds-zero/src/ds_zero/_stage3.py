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
* **Same path on every rank**: every request starts with a tiny all-gather of the unit's id, so ranks
  that call different modules fail at once with the module each rank asked for, instead of issuing
  collectives of different sizes that hang or mix data.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import ds_comm

from ._layout import Bucket, FlatLayout

logger = logging.getLogger(__name__)

END_OF_FORWARD, END_OF_BACKWARD = -1, -2
EXTERNAL = "_ds_external_parameters"  # a module's attribute: parameters it reads from other modules


def plan_units(model: nn.Module, params: list[nn.Parameter]) -> tuple[list[tuple[str, list[int]]],
                                                                       list[tuple[nn.Module, list[int]]]]:
    """The units (a name and parameter indices each) and the hooked modules (each with the units of
    every parameter below it), for ``params`` (the trainable parameters, in the model's order)."""
    index = {id(p): i for i, p in enumerate(params)}
    units: list[tuple[str, list[int]]] = []
    unit_of: dict[int, int] = {}
    holders: list[tuple[nn.Module, list[int]]] = []  # (module, parameter indices below it)
    seen: set[int] = set()

    def claim(name: str, members: list[int]) -> None:
        new = [i for i in dict.fromkeys(members) if i not in unit_of]
        if new:
            for i in new:
                unit_of[i] = len(units)
            units.append((name, new))

    root = [index[id(p)] for p in model.parameters(recurse=False) if id(p) in index]
    claim("<root>", root)
    if root:
        holders.append((model, root))

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            direct = [p for p in child.parameters(recurse=False) if id(p) in index]
            if direct:
                members = [index[id(p)] for p in child.parameters() if id(p) in index]
                claim(prefix + name, members)
                holders.append((child, members))
            else:
                walk(child, f"{prefix}{name}.")

    walk(model, "")
    hooked = [(module, list(dict.fromkeys(unit_of[i] for i in members))) for module, members in holders]
    return units, hooked


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
                 config: Any, group: Any, on_modified: Callable[[int], None], shards: Any = None):
        self.model, self.layout, self.group, self.partition = model, layout, group, partition
        self.world_size, self.rank = ds_comm.get_world_size(group), ds_comm.get_rank(group)
        self.shard_starts, self.dtype, self.on_modified = shard_starts, partition.dtype, on_modified
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
        self._empty = torch.empty(0, dtype=self.dtype)
        self._by_storage: dict[int, Unit] = {}
        self._trace: list[int] | None = None  # the requests of the last forward+backward
        self._recording: list[int] = []
        self._position: int | None = 0  # where this step is in the trace (None: off the trace)
        self._ahead: set[int] = set()  # units gathered ahead of their request
        self._in_backward: set[int] = set()  # units requested in this backward
        self._saved_hooks: list[Any] = []
        self.shards: Any = shards  # where this rank's shards are read and written when not in `partition` (NVMe)
        self._reads: dict[int, Any] = {}  # shard reads started for announced prefetches
        self._pool: dict[int, list[torch.Tensor]] = {}  # released gather buffers by size, for reuse
        self._pending: tuple[Any, list[int]] | None = None  # a check in flight and the prefetches it announces
        self.gathers = 0  # all-gathers issued (for tests and the benchmark)
        self._hooks: list[Any] = []
        self._names = {unit.index: unit.name for unit in self.units}
        self._check_group = _check_group(group)
        for p, (unit, k) in self._owners().items():
            p.ds_shape, p.ds_numel = unit.shapes[k], unit.shapes[k].numel()
            p._ds_stage3 = (self, unit.index)
        for module, units in hooked:
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward(units)))
            self._hooks.append(module.register_forward_hook(self._post_forward(units), always_call=True))
        if not any(module is model for module, _ in hooked):
            self._hooks.append(model.register_forward_pre_hook(self._pre_forward([])))
            self._hooks.append(model.register_forward_hook(self._post_forward([]), always_call=True))
        self._root = model
        for unit in self.units:
            if unit.persistent:
                self._gather(unit)
                self._point(unit)
            else:
                self._release_params(unit)

    def _owners(self) -> dict[nn.Parameter, tuple[Unit, int]]:
        return {p: (unit, k) for unit in self.units for k, p in enumerate(unit.params)}

    # ------------------------------------------------------------------------------------ hooks
    def _pre_forward(self, units: list[int]):
        def hook(module, args):
            if module is self._root:
                self._begin_forward()
            for u in [*units, *self._external_units(module)]:
                if not self.units[u].persistent:
                    self.request(self.units[u], "forward")
                    self.units[u].users += 1
        return hook

    def _post_forward(self, units: list[int]):
        def hook(module, args, output):
            used = [u for u in [*units, *self._external_units(module)] if not self.units[u].persistent]
            for u in used:
                self.units[u].users = max(0, self.units[u].users - 1)
                self._after_use(self.units[u])
            if used and torch.is_grad_enabled():  # gather them again when backward reaches this module
                for tensor in _tensors(output):
                    if tensor.requires_grad:
                        tensor.register_hook(self._pre_backward(used))
            if module is self._root:  # no collective when the forward raised (this hook is always called)
                self._end_forward(check=sys.exc_info()[0] is None)
        return hook

    def _pre_backward(self, units: list[int]):
        def hook(grad):
            for u in units:
                self._backward_request(self.units[u])
        return hook

    def _backward_request(self, unit: Unit) -> None:
        if unit.index not in self._in_backward or unit.full is None:
            self._in_backward.add(unit.index)
            self.request(unit, "backward")

    def _external_units(self, module: nn.Module) -> list[int]:
        out = []
        for p in getattr(module, EXTERNAL, ()):
            owner = getattr(p, "_ds_stage3", None)
            if owner is not None and owner[0] is self:
                out.append(owner[1])
        return out

    def _begin_forward(self) -> None:
        if self._saved_hooks:  # a forward that raised left its hooks on
            self._end_forward(check=False)
        if torch.is_grad_enabled():
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            hooks.__enter__()
            self._saved_hooks.append(hooks)
        if self._recording and not self._in_backward:  # the last forward had no backward (evaluation)
            self._restart()

    def _end_forward(self, check: bool = True) -> None:
        for unit in self.units:  # a forward that raised leaves users counted
            unit.users = 0
        while self._saved_hooks:
            self._saved_hooks.pop().__exit__(None, None, None)
        if check:
            self._flush()
            self._check(END_OF_FORWARD)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if not self._by_storage or tensor.layout != torch.strided:
            return tensor
        unit = self._by_storage.get(tensor.untyped_storage().data_ptr())
        if unit is None:
            return tensor
        return _Saved(unit.index, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        unit = self.units[saved.unit]
        self._backward_request(unit)
        return unit.full.as_strided(saved.size, saved.stride, saved.offset)

    # ---------------------------------------------------------------------------- fetch/release
    def request(self, unit: Unit, phase: str) -> None:
        """Make ``unit`` whole here: gather it (or wait for its prefetch), point its parameters at it,
        and decide what to prefetch. No gather is issued before every rank has said it issues the
        same: an on-demand gather checks at once (`_check`); prefetches are announced with a check
        that runs while this module computes and are issued at the next request (`_flush`), so a
        step that follows its trace waits for no other rank at module boundaries."""
        self._flush()
        self._recording.append(unit.index)
        code = 2 * unit.index + (phase == "backward")
        on_trace = False
        if self._position is not None and self._trace is not None:
            if self._position < len(self._trace) and self._trace[self._position] == unit.index:
                self._position += 1
                on_trace = True
            else:
                self._position = None
                self._drop_ahead()
        self._ahead.discard(unit.index)
        if unit.full is None:
            self._check(code, [unit.index])
            self._gather(unit)
        prefetch = self._to_prefetch() if on_trace else []
        if prefetch:
            self._pending = (self._start_check(code, prefetch), prefetch)
            for u in prefetch:  # shards on NVMe: their reads run while the check does and the module computes
                self._reads[u] = self._start_read(self.units[u])
        self._point(unit)

    def _flush(self) -> None:
        """The announced prefetches: wait for their check, then issue them."""
        if self._pending is None:
            return
        check, units = self._pending
        self._pending = None
        self._verify(*check)
        for u in units:
            if self.units[u].full is None:
                self._gather(self.units[u])
                self._ahead.add(u)
            else:  # gathered meanwhile (a tied weight): its read is not needed
                self._shard_of(self._reads.pop(u, self.partition[:0]))

    def _start_read(self, unit: Unit) -> Any:
        """This rank's shard of ``unit``: a view of the partition, or a read from NVMe started now."""
        start, shard = self.shard_starts[unit.index], unit.bucket.shard
        if self.shards is None:
            return self.partition[start:start + shard]
        return self.shards.start_read_params(start, shard)

    @staticmethod
    def _shard_of(read: Any) -> torch.Tensor:
        if isinstance(read, torch.Tensor):
            return read
        request, shard = read
        request.wait()
        return shard

    def _gather(self, unit: Unit) -> None:
        bucket = unit.bucket
        read = self._reads.pop(unit.index, None)
        shard = self._shard_of(read if read is not None else self._start_read(unit))
        unit.full = self._buffer(bucket.padded)
        unit.work = ds_comm.all_gather_bucket(unit.full, shard, group=self.group, async_op=True)
        self.gathers += 1
        if not unit.persistent:  # views of a persistent unit stay valid: autograd may keep them
            self._by_storage[unit.full.untyped_storage().data_ptr()] = unit

    def _buffer(self, numel: int) -> torch.Tensor:
        """A buffer for a gathered unit: a released one of the same size when there is one (units of
        one model repeat a few sizes), else a new one. Reuse keeps the allocator from fragmenting the
        heap with buffers of 1-16 MiB freed and allocated every step (RSS, and page faults)."""
        free = self._pool.get(numel)
        return free.pop() if free else torch.empty(numel, dtype=self.dtype)

    def _recycle(self, full: torch.Tensor) -> None:
        """Keep a released buffer for reuse, only if nothing else holds a view of it (a tensor of the
        user's, or one autograd saved outside our hooks): that view keeps its values."""
        try:
            alone = torch._C._storage_Use_Count(full.untyped_storage()._cdata) <= 2  # `full` and this query
        except (AttributeError, RuntimeError):  # a torch without the query: never reuse
            alone = False
        if alone:
            self._pool.setdefault(full.numel(), []).append(full)

    def _point(self, unit: Unit) -> None:
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        if not unit.pointed:
            for p, shape, offset in zip(unit.params, unit.shapes, unit.offsets, strict=True):
                p.data = unit.full[offset:offset + shape.numel()].view(shape)
            unit.pointed = True

    def _release_params(self, unit: Unit) -> None:
        for p in unit.params:
            p.data = self._empty
        unit.pointed = False

    def release(self, unit: Unit) -> None:
        """Back to the shard only (a gather still in flight completes first: every rank issued it)."""
        if unit.persistent or unit.held or unit.users or unit.full is None:
            return
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        self._by_storage.pop(unit.full.untyped_storage().data_ptr(), None)
        self._release_params(unit)
        full, unit.full = unit.full, None
        self._recycle(full)
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
        for u in self._trace[self._position:]:
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
        """The units next in the trace to gather now: none while more than half of
        ``stage3_prefetch_bucket_size`` is gathered ahead (so refills come in batches: fewer checks),
        else as many as fit in it and in ``stage3_max_live_parameters``."""
        ahead = sum(self.units[u].numel for u in self._ahead)
        if ahead > self.prefetch_bucket_size // 2:
            return []
        live = self.live_numel()
        out: list[int] = []
        for u in self._trace[self._position:]:
            unit = self.units[u]
            if unit.persistent or unit.full is not None or u in out:
                continue
            if ahead + unit.numel > self.prefetch_bucket_size or live + unit.bucket.padded > self.max_live:
                break
            out.append(u)
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
        self._check(END_OF_BACKWARD)
        for unit in self.units:
            self.release(unit)
        if self._position is None or self._trace is None or self._position != len(self._trace):
            if self._trace is not None:
                logger.debug("ZeRO-3: this step's module order differs from the last; re-recorded")
            self._trace = list(self._recording)
        self._restart()

    def _restart(self) -> None:
        self._recording = []
        self._position = 0
        self._in_backward.clear()
        self._drop_ahead()

    def after_step(self) -> None:
        """The optimizer updated the shards: persistent (and held) units gather them again."""
        gathered = [unit for unit in self.units if unit.full is not None]
        reads = [self._start_read(unit) for unit in gathered]
        works = [ds_comm.all_gather_bucket(unit.full, self._shard_of(read), group=self.group, async_op=True)
                 for unit, read in zip(gathered, reads, strict=True)]
        for work in works:
            work.wait()

    # --------------------------------------------------------------------------- desync guard
    def _check(self, code: int, gathers: list[int] = ()) -> None:
        """All ranks must be at the same point and about to issue the same gathers (see `_start_check`)."""
        self._verify(*self._start_check(code, gathers))

    def _start_check(self, code: int, gathers: list[int]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Announce ``code`` (2 × the unit requested + 1 in backward, or an END) and the units about to
        be gathered, on a group of its own. Only requests that gather announce (a request served by a
        prefetch issues no collective), so a rank whose path differs is caught at its first gather
        that differs, or at the end of the forward or backward, before any collective of other sizes."""
        digest = 0
        for u in gathers:
            digest = (digest * 1_000_003 + u + 1) % (1 << 61)
        mine = torch.tensor([code, len(gathers), digest], dtype=torch.int64)
        everyone = torch.empty(3 * self.world_size, dtype=torch.int64)
        work = ds_comm.all_gather_into_tensor(everyone, mine, group=self._check_group, async_op=True)
        return work, everyone, mine

    def _verify(self, work: Any, everyone: torch.Tensor, mine: torch.Tensor) -> None:
        work.wait()
        if bool((everyone.view(-1, 3) == mine).all()):
            return
        asked = "; ".join(f"rank {r}: {self._describe(int(c))}" for r, c in enumerate(everyone.view(-1, 3)[:, 0]))
        raise RuntimeError(f"ZeRO stage 3: the ranks took different paths through the model ({asked}). Every rank "
                           "must call the same modules in the same order (data-dependent branches must decide the "
                           "same on every rank), since each module's parameters are gathered from all ranks")

    def _describe(self, code: int) -> str:
        if code == END_OF_FORWARD:
            return "the end of the forward"
        if code == END_OF_BACKWARD:
            return "the end of the backward"
        unit, backward = divmod(code, 2)
        return f"the parameters of {self._names.get(unit, f'unit {unit}')!r} ({'backward' if backward else 'forward'})"

    # ------------------------------------------------------------------------- gather for users
    def hold(self, unit: Unit) -> None:
        """Gather ``unit`` and keep it whole until `unhold` (GatheredParameters)."""
        if unit.full is None:
            self._gather(unit)
        self._point(unit)
        unit.held += 1

    def unhold(self, unit: Unit, modifier_rank: int | None) -> None:
        """End a hold: with ``modifier_rank``, its full values go to every rank and into the shards."""
        if modifier_rank is not None:
            source = ds_comm.get_global_rank(self.group, modifier_rank) if self.group is not None else modifier_rank
            ds_comm.broadcast(unit.full, src=source, group=self.group)
            start, shard = self.shard_starts[unit.index], unit.bucket.shard
            mine = unit.full[self.rank * shard:(self.rank + 1) * shard]
            if self.shards is None:
                self.partition[start:start + shard].copy_(mine)
            else:
                self.shards.write_params(start, mine)
            self.on_modified(unit.index, mine)
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
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._end_forward(check=False)
        self._pool.clear()
        for p in (p for unit in self.units for p in unit.params):
            if getattr(p, "_ds_stage3", (None,))[0] is self:
                del p._ds_stage3

    def empty_cache(self) -> None:
        """Release every unit not persistent, held or in use, and drop the pooled gather buffers."""
        self._flush()
        self._drop_ahead()
        for unit in self.units:
            self.release(unit)
        self._pool.clear()

    def held_bytes(self) -> int:
        """Bytes of gathered buffers (persistent and in use)."""
        return sum(u.full.numel() * u.full.element_size() for u in self.units if u.full is not None)

    def pooled_bytes(self) -> int:
        """Bytes of released gather buffers kept for reuse."""
        return sum(t.numel() * t.element_size() for free in self._pool.values() for t in free)


_check_groups: dict[tuple, Any] = {}


def _check_group(group: Any) -> Any:
    """A process group of ``group``'s ranks for the path checks alone. On the data group a check
    would queue behind the gathers and reductions in flight (gloo runs a group's collectives in
    order), making every request wait for them: 27% of a step on the §9 workload. Made once per
    set of ranks (creating a group is a collective of every rank)."""
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
    key = (id(dist.distributed_c10d._get_default_group()), ranks)
    if key not in _check_groups:
        _check_groups[key] = ds_comm.new_group(list(ranks))
    return _check_groups[key]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's output (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif hasattr(value, "to_tuple"):  # Hugging Face ModelOutput
        yield from _tensors(value.to_tuple())


def units_of(params: Iterable[nn.Parameter]) -> dict[Stage3, list[Unit]]:
    """The stage-3 units holding ``params``, by owner."""
    out: dict[Stage3, list[Unit]] = {}
    for p in params:
        owner = getattr(p, "_ds_stage3", None)
        if owner is not None:
            stage3, index = owner
            units = out.setdefault(stage3, [])
            if stage3.units[index] not in units:
                units.append(stage3.units[index])
    return out
