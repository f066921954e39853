"""Sharded checkpoints of a `ZeroOptimizer` through ``torch.distributed.checkpoint`` (DCP).

Each rank describes what it holds as 1-D shards of each *whole flattened parameter*: its pieces of the
float32 master weights (``master/<name>``; with ``bf16.bf16_master_weights_and_grads`` the bf16
parameters themselves, and a checkpoint loads into either, converted) and of every optimizer state of
the same size (``optim/<key>/<name>``), plus replicated scalars (``optim_scalar/<key>``) and the
module's buffers and frozen parameters (``module/<name>``). Which rank held which range is recorded
by DCP, so a checkpoint saved by N ranks at stage s loads into M ranks at stage t: each loading rank asks for
its own pieces (stage 1-2) or whole tensors (stage 0), and DCP's planner reads the overlapping ranges of the
saved shards. The rest (loss scaler, counters, hyperparameters) is plain data returned by `zero_metadata`.

When ZeRO's data-parallel group is not the whole world (a pipeline: each stage's group holds its own
layers), the checkpoint is the union of every group's: shards are placed by world rank, a parameter
held by several groups (a weight tied across stages) is written by the group of the lowest rank, and
``zero_meta.json`` lists every group's parameters; loading reads each group's own, so a pipeline's
checkpoint loads into another stage count (or none) wherever the parameter names agree. Parameters
replicated over subgroups of ZeRO's group (a parameter group's ``process_group``, `_replicas`: MoE
experts) are the same case within one group: each is written by the ranks of the subgroup holding the
lowest world rank that holds it (as the pieces they hold), under its checkpoint name (the caller maps
local expert names to global ones with ``checkpoint_names``), and loads into any other grouping.

A parameter sliced over a tensor-parallel group (Megatron's ``tensor_model_parallel``/``partition_dim`` marks,
given the group: ``tensor_parallel_group``) is saved whole, each slice's pieces as the runs of the whole they
cover (`_checkpoint_tp`): it loads at any tensor-parallel size, the unsplit model's too (whole shapes recorded).

ZeRO's shards end at bucket boundaries, not at even splits of each parameter, so they cannot be DTensor
``Shard(0)`` placements: they are `ShardedTensor`s (DCP's type for arbitrary shards) built from metadata
every rank computes alone, with no collective."""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from ds_config import write_atomic

from ._checkpoint_tp import Slice, checkpoint_slices, sharded_slice
from ._compressed import CompressedOptimizer
from ._model import param_name
from ._nvme import STATES
from ._replicas import GROUPING_MARKS

if TYPE_CHECKING:
    import torch.distributed.checkpoint as dcp

    from ._nvme_checkpoint import NvmeEntries
    from ._optimizer import ZeroOptimizer

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )


logger = logging.getLogger(__name__)


def _dcp():
    """``torch.distributed.checkpoint``, imported at a checkpoint's save or load: it pulls in DTensor and sympy,
    about 4 s on this CPU, which every process importing ds_zero (each launched rank) would pay otherwise."""
    import torch.distributed.checkpoint

    return torch.distributed.checkpoint

FORMAT = 1  # bumped when the layout of keys changes


def _sharded(local: torch.Tensor | None, start: int, ranges: list[tuple[int, int, int]], numel: int,
             dtype: torch.dtype, rank: int) -> ShardedTensor:
    """A 1-D `ShardedTensor` of ``numel`` elements whose shards are ``ranges`` ((rank, start, length));
    this rank's is ``local`` (starting at ``start``), or none."""
    metas = [ShardMetadata([s], [n], f"rank:{r}/cpu") for r, s, n in ranges]
    properties = TensorProperties.create_from_tensor(torch.empty(0, dtype=dtype))
    shards = [Shard(local, ShardMetadata([start], [local.numel()], f"rank:{rank}/cpu"))] if local is not None else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, ShardedTensorMetadata(metas, torch.Size([numel]), properties))


def _names(zero: ZeroOptimizer) -> list[str]:
    """The parameters' names in checkpoints (``checkpoint_names`` where given, else the model's)."""
    names = {id(p): name for name, p in zero.model.named_parameters()}  # one walk (param_name walks per call)
    params = [record.param for record in zero.internals.records]
    return [_saved_name(zero, names[id(p)] if id(p) in names else param_name(zero.model, p)) for p in params]


def _saved_name(zero: ZeroOptimizer, name: str) -> str:
    return zero.checkpoint_names.get(name, name)


def _world_rank(zero: ZeroOptimizer, rank: int) -> int:
    """The world rank of ``zero``'s data-parallel rank ``rank`` (shards are placed by world rank)."""
    return rank if zero.group is None else torch.distributed.get_global_rank(zero.group, rank)


@dataclass(frozen=True)
class _Parts:
    """What every data-parallel group of the world holds, when ``zero``'s is not the whole world."""
    names: list[str]  # every group's parameters, each once, in the order of the groups
    shapes: dict[str, list[int]]
    others: set[str]  # every group's buffers and frozen parameters (``module/<name>``)
    excluded_frozen: list[str]
    frozen: list[str]  # every group's frozen parameters
    not_mine: set[str]  # parameters this group holds but another (of a lower rank) writes


def _shapes(zero: ZeroOptimizer, tp: dict[int, Slice]) -> list[list[int]]:
    """The parameters' shapes in checkpoints: a tensor-parallel slice's is the whole parameter's."""
    return [list(tp[i].full_shape) if i in tp else list(s.shape) for i, s in enumerate(zero.layout.slots)]


def _parts(zero: ZeroOptimizer, exclude_frozen: bool = False, tp: dict[int, Slice] | None = None) -> _Parts | None:
    """None when ``zero``'s group is the whole world and holds no parameters replicated over subgroups;
    else every rank's parameters (a collective of the world: every rank calls it). A parameter is written
    by the ranks holding it together with the lowest world rank holding it (its ZeRO group, or its
    subgroup); a tensor-parallel slice (``tp``) by the lowest holding that slice, so every slice is written."""
    world = torch.distributed.get_world_size()
    tp = tp or {}
    if zero.world_size == world and not zero.internals.replica_groups:
        return None
    names = _names(zero)
    keys = [tp[i].rank if i in tp else -1 for i in range(len(names))]
    mine = (_world_rank(zero, zero.rank), names, _shapes(zero, tp), sorted(_other_entries(zero, values=False)),
            _frozen_names(zero), keys)
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, mine)
    writer: dict[tuple[str, int], int] = {}
    shapes: dict[str, list[int]] = {}
    others: set[str] = set()
    every_frozen: list[str] = []
    for rank, rank_names, rank_shapes, rank_others, frozen, rank_keys in sorted(gathered, key=lambda g: g[0]):
        for name, shape, key in zip(rank_names, rank_shapes, rank_keys, strict=True):
            writer.setdefault((name, key), rank)  # the lowest world rank holding it (that slice of it)
            shapes.setdefault(name, shape)
        others.update(rank_others)
        every_frozen += [n for n in frozen if n not in every_frozen]
    holders = [{_world_rank(zero, r) for r in zero.layout.buckets[slot.bucket].ranks} for slot in zero.layout.slots]
    return _Parts(list(shapes), shapes, others, every_frozen if exclude_frozen else [], every_frozen,
                  {n for n, key, held in zip(names, keys, holders, strict=True) if writer[(n, key)] not in held})


def _pieces_by_param(zero: ZeroOptimizer) -> dict[int, list[tuple[int, int, int]]]:
    """For each parameter: the (world rank, start, length) of every rank's piece of it (its flattened form)."""
    out: dict[int, list[tuple[int, int, int]]] = {i: [] for i in range(len(zero.internals.records))}
    for rank in range(zero.world_size):
        for piece in zero.layout.pieces(rank):
            out[piece.index].append((_world_rank(zero, rank), piece.param_offset, piece.numel))
    return out


def _master_dtype(zero: ZeroOptimizer) -> torch.dtype:
    """The saved master weights' dtype: float32, or bf16 with bf16 master weights (no float32 copy exists)."""
    return zero.internals.flat.dtype if zero.policy.bf16_master else torch.float32


def _fresh_state_dtypes(zero: ZeroOptimizer) -> dict[int, torch.dtype]:
    """For each stepped tensor: the dtype its optimizer states are made in before a load writes them (the
    fused step's, from ds-ops' ``state_dtype``; else the tensor's own, as torch's optimizers keep them)."""
    recipe = zero.internals.recipe
    if recipe is None:
        return {id(t): t.dtype for t in zero.internals.step_tensors}
    return {id(t): recipe.state_dtype(group, t.dtype) for group in zero.optimizer.param_groups for t in group["params"]}


def _tensor_states(zero: ZeroOptimizer) -> tuple[list[str], list[str]]:
    """The inner optimizer's state keys: those holding a tensor the size of its stepped tensor (sharded
    per parameter), and the others (scalars, kept once). ZeRO-Infinity's Adam states are in its files,
    its step count in the optimizer's state."""
    if not zero.optimizer.state:
        return [], []
    if zero.internals.nvme is not None:
        return list(STATES), ["step"]
    first = zero.internals.step_tensors[0]
    state = zero.optimizer.state[first]
    numel = first.numel()
    sized = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0 and v.numel() == numel)
    scalars = sorted(k for k in state if k not in sized)
    return sized, scalars


def _on_host(t: torch.Tensor, back: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    """``t`` where DCP's files are written from and read into: itself on the host; a host copy of a
    device tensor (``back``: gets (device tensor, copy), for a load to copy the values read back)."""
    if t.device.type == "cpu":
        return t
    host = t.detach().to("cpu")
    if back is not None:
        back.append((t, host))
    return host


def _piece_entries(zero: ZeroOptimizer, sized: list[str], skip: set[str] = frozenset(),
                   copy: bool = False, lazy: NvmeEntries | None = None,
                   back: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                   tp: dict[int, Slice] | None = None) -> dict[str, ShardedTensor]:
    """``master/<name>`` and ``optim/<key>/<name>`` for every parameter but ``skip``: ShardedTensors whose
    local shard is a view of this rank's piece (nothing, where it holds none; ``copy``: a copy of it;
    a host copy of a piece on a device, listed in ``back`` for a load). DCP reads them to save and
    writes into them to load. ``lazy`` (ZeRO-Infinity): the pieces on NVMe are placeholders,
    registered there for its planners to move. ``tp``: the tensor-parallel slices, each described
    as runs of its whole parameter (`_checkpoint_tp`)."""
    def view(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            return _on_host(t, back)
        return t.clone() if copy else t

    names, by_param, master = _names(zero), _pieces_by_param(zero), zero.internals.master
    tensors = zero.internals.step_tensors
    dtypes = {key: torch.float32 if lazy is not None else zero.optimizer.state[tensors[0]][key].dtype for key in sized}
    views: dict[int, tuple[Any, int, torch.Tensor, dict[str, torch.Tensor], dict[str, tuple[str, int]]]] = {}
    for record, piece in zero.internals.records.shards():
        n, on_disk, in_master = piece.numel, {}, piece.in_master
        if lazy is None:
            state = zero.optimizer.state[tensors[piece.run]]
            weights = view(master[in_master:in_master + n])
            states = {key: view(state[key][piece.in_run:piece.in_run + n]) for key in sized}
        else:  # stage 3: the states' files are indexed by the partition's offsets, as the master copy
            on_disk = {f"optim/{key}": (key, in_master) for key in sized}
            if lazy.master_kind is not None:
                on_disk["master"] = (lazy.master_kind, in_master)
            weights = lazy.placeholder("master", in_master, n) if "master" in on_disk else \
                view(master[in_master:in_master + n])
            states = {key: lazy.placeholder(key, in_master, n) for key in sized}
        views[record.index] = (piece.param_offset, n, weights, states, on_disk)
    out, rank = {}, _world_rank(zero, zero.rank)
    for index, name in enumerate(names):
        if name in skip:
            continue
        numel, ranges = zero.layout.slots[index].numel, by_param[index]
        start, n, weights, states, on_disk = views.get(index, (0, 0, None, {}, {}))
        if tp and index in tp:
            world = torch.distributed.get_world_size()
            out[f"master/{name}"] = sharded_slice(weights, start, tp[index], _master_dtype(zero), rank, world)
            for key in sized:
                out[f"optim/{key}/{name}"] = sharded_slice(states.get(key), start, tp[index], dtypes[key], rank, world)
            continue
        out[f"master/{name}"] = _sharded(weights, start, ranges, numel, _master_dtype(zero), rank)
        for key in sized:
            out[f"optim/{key}/{name}"] = _sharded(states.get(key), start, ranges, numel, dtypes[key], rank)
        for entry, (kind, at) in on_disk.items():
            lazy.add(f"{entry}/{name}", kind, at, n)
    return out


def _other_entries(zero: ZeroOptimizer, exclude_frozen: bool = False, values: bool = True) -> dict[str, torch.Tensor]:
    """The module's tensors ZeRO does not hold (buffers, frozen parameters), replicated, whole: stage 3's
    partitioned frozen parameters are gathered into copies (a collective; not with ``values=False``,
    where only the names are used)."""
    trainable = {id(record.param) for record in zero.internals.records}
    frozen = [] if exclude_frozen else list(zero.model.named_parameters())
    shards = zero.internals.frozen
    whole = shards.whole() if shards is not None and frozen and values else {}
    transient = _non_persistent_buffers(zero.model)
    return {f"module/{_saved_name(zero, name)}": whole.get(id(tensor), tensor.detach())
            for name, tensor in [*frozen, *zero.model.named_buffers()]
            if id(tensor) not in trainable and name not in transient}


def _non_persistent_buffers(model: torch.nn.Module) -> set[str]:
    """The buffers ``load_state_dict`` neither saves nor expects (``register_buffer(..., persistent=False)``: a
    Hugging Face BERT's ``position_ids``): not in ``state_dict``'s keys. A checkpoint has none of them (DeepSpeed's
    never had; ds-zero's did before 2026-12) and a load leaves the model's own values."""
    persistent = set(model.state_dict(keep_vars=True))
    return {name for name, _ in model.named_buffers() if name not in persistent}


def _load_frozen(zero: ZeroOptimizer, loaded: dict[str, Any]) -> None:
    """Stage 3: the frozen parameters read whole (into copies) go into their partition."""
    shards = zero.internals.frozen
    if shards is None:
        return
    names = {id(p): _saved_name(zero, name) for name, p in zero.model.named_parameters()}
    shards.load_whole({id(p): loaded[f"module/{names[id(p)]}"] for p in shards.params
                       if f"module/{names[id(p)]}" in loaded})


def _frozen_names(zero: ZeroOptimizer) -> list[str]:
    trainable = {id(record.param) for record in zero.internals.records}
    return [_saved_name(zero, name) for name, p in zero.model.named_parameters()
            if id(p) not in trainable and not p.requires_grad]


def _nvme_entries(zero: ZeroOptimizer) -> NvmeEntries | None:
    nvme = zero.internals.nvme
    if nvme is None:
        return None
    # DCP's planners: imported with a checkpoint (see _dcp)
    from ._nvme_checkpoint import NvmeEntries

    return NvmeEntries(nvme)


def zero_state(zero: ZeroOptimizer, exclude_frozen_parameters: bool = False,
               parts: _Parts | None = None, copy: bool = False, lazy: NvmeEntries | None = None,
               tp: dict[int, Slice] | None = None) -> dict[str, Any]:
    """This rank's part of the checkpoint as a DCP state dict (see the module docstring); ``parts``:
    what every group holds, when ``zero``'s group is not the whole world (`_parts`); ``copy``: copies
    that training cannot change (what an asynchronous save writes), not views; ``lazy``: ZeRO-Infinity's
    entries (`_nvme_entries`), whose planner reads their bytes from disk (no ``copy`` then); ``tp``: the
    tensor-parallel slices (`checkpoint_slices`)."""
    if zero.internals.nvme is not None and (lazy is None or copy):
        raise ValueError("zero_state: ZeRO-Infinity's states are read from disk as they are written: pass "
                         "lazy=_nvme_entries(zero) and its save_planner() to dcp.save, and no copy")
    sized, scalars = _tensor_states(zero)
    out: dict[str, Any] = _piece_entries(zero, sized, parts.not_mine if parts is not None else set(), copy, lazy,
                                         tp=tp)
    first = zero.optimizer.state[zero.internals.step_tensors[0]] if scalars else {}
    for key in scalars:
        value = first[key]
        out[f"optim_scalar/{key}"] = value.detach().clone() if torch.is_tensor(value) else torch.tensor(value)
    out.update(_other_entries(zero, exclude_frozen_parameters))
    if isinstance(zero.optimizer, CompressedOptimizer):  # a 1-bit optimizer's error feedback: this rank's own
        out.update({f"rank_state/{zero.rank}/{key}": t for key, t in zero.optimizer.rank_state().items()})
    return {k: (v.clone() if copy and v.device.type == "cpu" else _on_host(v))
            if torch.is_tensor(v) and not isinstance(v, ShardedTensor) else v for k, v in out.items()}


def zero_metadata(zero: ZeroOptimizer, exclude_frozen_parameters: bool = False,
                  parts: _Parts | None = None, tp: dict[int, Slice] | None = None) -> dict[str, Any]:
    """The plain-data part: what loading needs to check and restore besides tensors (with ``parts``: every
    group's parameters; a tensor-parallel slice's shape is its whole parameter's)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in zero.optimizer.param_groups]
    if parts is None:
        names, shapes = _names(zero), _shapes(zero, tp or {})
        frozen = _frozen_names(zero)
        excluded = frozen if exclude_frozen_parameters else []
    else:
        names, shapes, excluded = parts.names, [parts.shapes[n] for n in parts.names], parts.excluded_frozen
        frozen = parts.frozen
    return {"format": FORMAT, "zero_stage": zero.stage, "world_size": zero.world_size, "precision": zero.precision,
            "optimizer": type(zero.optimizer).__name__, "param_groups": groups,
            "names": names, "shapes": shapes, "excluded_frozen": excluded, "frozen": frozen,
            "shared_params": _shared_params(zero),
            "micro_step": zero.internals.micro_step, "skipped_steps": zero.skipped_steps,
            "loss_scaler": zero.scaler.state_dict() if zero.scaler is not None else None}


def _shared_params(zero: ZeroOptimizer) -> dict[str, str]:
    """A tied parameter's other names -> the name it is saved under (DeepSpeed's ``shared_params``)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in zero.model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[_saved_name(zero, name)] = _saved_name(zero, first[id(p)])
        else:
            first[id(p)] = name
    return aliases


def _listing(kind: str, names: list[str]) -> list[str]:
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return [f"{kind}: {', '.join(names[:5])}{more}"] if names else []


def check_compatible(zero: ZeroOptimizer, meta: dict[str, Any], where: str, strict: bool = True,
                     parts: _Parts | None = None, tp: dict[int, Slice] | None = None) -> None:
    """The model of ``meta`` (a saved `zero_metadata`) must be ``zero``'s (with ``parts``: every group's
    together): same parameter names and shapes (``strict=False``: parameters on one side only are
    allowed; shapes must still agree; a tensor-parallel slice's shape is its whole parameter's); any
    world size, stage and tensor-parallel size are fine."""
    if meta.get("format") != FORMAT:
        raise ValueError(f"{where}: checkpoint format {meta.get('format')!r}, this ds-zero reads {FORMAT}")
    names, shapes = _names(zero), _shapes(zero, tp or {})
    everyone = set(parts.names) if parts is not None else set(names)
    saved = dict(zip(meta["names"], meta["shapes"], strict=True))
    missing = [n for n in names if n not in saved] if strict else []
    extra = [n for n in saved if n not in everyone] if strict else []
    wrong = [f"{n}: saved {saved[n]}, model {s}" for n, s in zip(names, shapes, strict=True)
             if n in saved and saved[n] != s]
    if missing or extra or wrong:
        parts = _listing("missing from the checkpoint", missing) + _listing("not in the model", extra) + \
            _listing("other shapes", wrong)
        raise ValueError(f"{where}: the checkpoint is of another model ({' | '.join(parts)})"
                         + (" (load_module_strict=False loads the parameters both have)" if missing or extra else ""))


def _module_entries(zero: ZeroOptimizer, meta: dict[str, Any], saved: dict[str, Any], where: str,
                    strict: bool, parts: _Parts | None = None) -> dict[str, torch.Tensor]:
    """The buffers and frozen parameters to read: all of them (frozen ones saved with
    ``exclude_frozen_parameters`` keep the model's values); a tensor on one side only is an error when
    ``strict``, skipped otherwise; a shape that differs always is."""
    mine = _other_entries(zero)
    excluded = {f"module/{name}" for name in meta.get("excluded_frozen", [])}
    transient = {f"module/{_saved_name(zero, name)}" for name in _non_persistent_buffers(zero.model)}
    saved_module = {k for k in saved if k.startswith("module/") and k not in transient}  # older ds-zero saved them
    missing = sorted(k[7:] for k in mine if k not in saved and k not in excluded) if strict else []
    everyone = parts.others if parts is not None else set(mine)
    extra = sorted(k[7:] for k in saved_module if k not in everyone) if strict else []
    wrong = [f"{k[7:]}: saved {list(saved[k].size)}, model {list(t.shape)}" for k, t in mine.items()
             if k in saved and tuple(saved[k].size) != tuple(t.shape)]
    if missing or extra or wrong:
        parts = _listing("buffers or frozen parameters missing from the checkpoint", missing) + \
            _listing("not in the model", extra) + _listing("other shapes", wrong)
        raise ValueError(f"{where}: the checkpoint is of another model ({' | '.join(parts)})"
                         + (" (load_module_strict=False loads the tensors both have)" if missing or extra else ""))
    return {k: t for k, t in mine.items() if k in saved}


def _rank_state_wanted(zero: ZeroOptimizer, meta: dict[str, Any], saved_keys: set[str]) -> dict[str, Any] | None:
    """A 1-bit optimizer's error feedback to read for this rank: what the same rank saved, on the same
    world size; None (it restarts at zero, as DeepSpeed's always does) otherwise."""
    if not isinstance(zero.optimizer, CompressedOptimizer):
        return None
    if meta["world_size"] != zero.world_size:
        logger.warning("ZeroOptimizer.load: the checkpoint is of %d ranks, this run has %d: %s's error feedback "
                       "restarts at zero", meta["world_size"], zero.world_size, type(zero.optimizer).__name__)
        return None
    prefix = f"rank_state/{zero.rank}/"
    return {key: t for key, t in zero.optimizer.rank_state_template().items() if prefix + key in saved_keys}


def _reader(checkpoint_id: Any) -> dcp.StorageReader:
    """A checkpoint directory's reader, or ``checkpoint_id`` itself when it is one (a DeepSpeed checkpoint's)."""
    from ._storage import SafeReader

    return checkpoint_id if isinstance(checkpoint_id, _dcp().StorageReader) else SafeReader(checkpoint_id)


def load_zero_state(zero: ZeroOptimizer, checkpoint_id: Any, meta: dict[str, Any], *, load_optimizer: bool = True,
                    extra: dict[str, Any] | None = None, strict: bool = True,
                    tensor_parallel_group: Any = None) -> None:
    """Load a checkpoint written by `zero_state` from any world size and stage into ``zero``, in place
    (every rank calls it; DCP reads only the ranges this rank holds). ``strict=False``: parameters,
    buffers and frozen parameters on one side only are skipped (the model keeps its own values, and a
    parameter the checkpoint lacks starts with fresh optimizer states). ``tensor_parallel_group``: the
    group over which the parameters marked ``tensor_model_parallel`` are sliced (each rank reads its
    slice of the whole, whatever tensor-parallel size saved it)."""
    lazy = _nvme_entries(zero)  # ZeRO-Infinity: the ranges read go to disk through its planner
    tp = checkpoint_slices(zero, tensor_parallel_group, lazy is not None)
    parts = _parts(zero, tp=tp)
    check_compatible(zero, meta, "ZeroOptimizer.load", strict, parts, tp)
    saved_metadata = _reader(checkpoint_id).read_metadata().state_dict_metadata
    saved_keys = set(saved_metadata)
    sized = sorted({k.split("/")[1] for k in saved_keys if k.startswith("optim/")}) if load_optimizer else []
    scalars = sorted(k.split("/", 1)[1] for k in saved_keys if k.startswith("optim_scalar/")) if load_optimizer else []
    fresh, internals = _fresh_state_dtypes(zero), zero.internals
    for tensor in internals.step_tensors if lazy is None else ():  # states the optimizer has not made yet
        state = zero.optimizer.state[tensor]
        for key in sized:
            if key not in state:
                state[key] = torch.zeros_like(tensor, dtype=fresh[id(tensor)], device=tensor.device)
    wanted: dict[str, Any] = {}
    back: list[tuple[torch.Tensor, torch.Tensor]] = []  # device tensors read through host copies
    if not zero.policy.shard_optimizer:  # every rank holds everything: whole tensors, read from whichever shards hold them
        master = internals.master
        for record, name in zip(internals.records, _names(zero), strict=True):
            held = record.held  # the whole parameter
            wanted[f"master/{name}"] = master[held.in_master:held.in_master + held.numel]
            for key in sized:
                state = zero.optimizer.state[internals.step_tensors[held.run]]
                wanted[f"optim/{key}/{name}"] = state[key][held.in_run:held.in_run + held.numel]
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        for index, name in enumerate(_names(zero)):  # a tensor-parallel slice: its runs of the whole
            for key in (f"master/{name}", *(f"optim/{s}/{name}" for s in sized)) if index in tp else ():
                local = _on_host(wanted[key], back)
                wanted[key] = sharded_slice(local, 0, tp[index], local.dtype, rank, world)
    else:
        wanted.update(_piece_entries(zero, sized, lazy=lazy, back=back, tp=tp))
    wanted = {key: value for key, value in wanted.items() if key in saved_keys}  # strict: every one of them
    scalar_values = {key: torch.zeros((), device="cpu") for key in scalars}
    wanted.update({f"optim_scalar/{key}": value for key, value in scalar_values.items()})
    wanted.update(_module_entries(zero, meta, saved_metadata, "ZeroOptimizer.load", strict, parts))
    rank_state = _rank_state_wanted(zero, meta, saved_keys) if load_optimizer else None
    wanted.update({f"rank_state/{zero.rank}/{key}": t for key, t in (rank_state or {}).items()})
    wanted = {key: _on_host(value, back) if torch.is_tensor(value) and not isinstance(value, ShardedTensor) else value
              for key, value in wanted.items()}
    wanted.update(extra or {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        _dcp().load(wanted, storage_reader=_reader(checkpoint_id),
                 planner=lazy.load_planner() if lazy is not None else None)
    for target, host in back:  # the values read, into the device tensors
        target.copy_(host)
    _load_frozen(zero, wanted)
    for key, value in scalar_values.items():
        for tensor in internals.step_tensors:
            zero.optimizer.state[tensor][key] = value.clone()
    if load_optimizer and isinstance(zero.optimizer, CompressedOptimizer):
        zero.optimizer.load_rank_state(rank_state)
    if load_optimizer:
        for group, saved in zip(zero.optimizer.param_groups, meta["param_groups"], strict=False):
            group.update({k: (tuple(v) if isinstance(group.get(k), tuple) else v) for k, v in saved.items()
                          if k not in GROUPING_MARKS})  # the loading run's grouping stays its own
        internals.micro_step = int(meta["micro_step"])
        zero.skipped_steps = int(meta["skipped_steps"])
        if zero.scaler is not None and meta.get("loss_scaler") is not None:
            zero.scaler.load_state_dict(meta["loss_scaler"])
        internals.next_reduction()  # a 1-bit optimizer's loaded step decides whether the next gradients are averaged
    internals.master_loaded()  # the 16-bit parameters follow, on every rank


META_FILE = "zero_meta.json"


def save_zero_checkpoint(zero: ZeroOptimizer, path: Any, *, extra: dict[str, Any] | None = None,
                         exclude_frozen_parameters: bool = False, async_group: Any = None,
                         tensor_parallel_group: Any = None) -> Future | None:
    """Write ``zero``'s sharded checkpoint into the directory ``path`` (every rank calls it): DCP's files
    and rank 0's ``zero_meta.json``. ``extra``: more DCP entries of this rank (the engine's).
    ``exclude_frozen_parameters``: leave out the parameters with ``requires_grad=False`` (a frozen
    pretrained backbone); loading keeps the model's values for them.
    ``async_group``: write in the background and return at once with a `Future` (done when this rank's
    files are written and fsynced; on rank 0, when every rank's are and DCP's metadata is): what
    is written is copied first, so training may go on. The group (of every rank, used by the writing
    thread only, e.g. ``torch.distributed.new_group(backend="gloo")``) keeps the background's
    collectives apart from training's. With ZeRO-Infinity (``offload_optimizer.device: nvme``) the
    save is synchronous (its states are read from disk piece by piece as they are written; a copy
    would need them in RAM) and the returned `Future` is done. ``tensor_parallel_group``: the group over
    which the parameters marked ``tensor_model_parallel`` are sliced; each slice is saved as its part of
    the whole parameter, so the checkpoint loads at any tensor-parallel size (`_checkpoint_tp`)."""
    import json
    import os

    lazy = _nvme_entries(zero)
    tp = checkpoint_slices(zero, tensor_parallel_group, lazy is not None)
    parts = _parts(zero, exclude_frozen_parameters, tp)
    if lazy is not None and async_group is not None:  # its states on disk would change under a background write
        logger.info("save_zero_checkpoint: ZeRO-Infinity's states are read from NVMe as they are written; this "
                    "save is synchronous")
        async_group = None
        done: Future | None = Future()
    else:
        done = None
    state = zero_state(zero, exclude_frozen_parameters, parts, copy=async_group is not None, lazy=lazy, tp=tp)
    if extra:
        clash = sorted(set(state) & set(extra))
        if clash:
            raise ValueError(f"save_zero_checkpoint: extra keys {clash} clash with ZeRO's")
        state.update(extra)
    if torch.distributed.get_rank() == 0:  # into the directory first: DCP's files are what completes it
        os.makedirs(path, exist_ok=True)
        write_atomic(os.path.join(path, META_FILE), json.dumps(zero_metadata(zero, exclude_frozen_parameters, parts, tp)))
    from ._storage import RawWriter

    dcp = _dcp()
    writer = RawWriter(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if async_group is None:
            dcp.save(state, storage_writer=writer, planner=lazy.save_planner() if lazy is not None else None)
            if done is not None:  # asked for asynchronously: already written
                done.set_result(None)
            return done
    state.update({k: v.detach().clone() for k, v in (extra or {}).items()})  # the caller's may change too
    # our own thread rather than dcp.async_save, whose staging walk and thread pool the caller waits for
    # (the 34M GPT's save blocked training 0.12-0.20 s with it, 0.09 s without); the state is copied already
    return _in_background(functools.partial(dcp.save, state, storage_writer=writer, process_group=async_group))


def _in_background(work: Callable[[], Any]) -> Future:
    done: Future = Future()

    def run() -> None:
        try:  # (no warnings.catch_warnings here: it is not thread-safe)
            done.set_result(work())
        except BaseException as e:  # handed to the caller through the future
            done.set_exception(e)

    threading.Thread(target=run, name="ds_zero checkpoint writer", daemon=True).start()
    return done


def read_zero_metadata(path: Any) -> dict[str, Any]:
    """The ``zero_meta.json`` of a checkpoint directory (a clear error when it is missing or torn)."""
    import json
    import os

    target = os.path.join(path, META_FILE)
    try:
        with open(target) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{target}: not a ds-zero checkpoint (no {META_FILE})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{target}: truncated or corrupt ({e})") from None


def load_zero_checkpoint(zero: ZeroOptimizer, path: Any, *, load_optimizer: bool = True,
                         extra: dict[str, Any] | None = None, strict: bool = True,
                         tensor_parallel_group: Any = None) -> dict[str, Any]:
    """Load a checkpoint directory written by `save_zero_checkpoint` on any world size, stage and
    tensor-parallel size into ``zero`` (every rank calls it); ``extra``: more DCP entries to read in
    place; ``strict=False``: tensors on one side only are skipped; ``tensor_parallel_group``: as
    `load_zero_state`'s. Returns the metadata."""
    meta = read_zero_metadata(path)
    load_zero_state(zero, path, meta, load_optimizer=load_optimizer, extra=extra, strict=strict,
                    tensor_parallel_group=tensor_parallel_group)
    return meta
