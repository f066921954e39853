"""`Init` (build a model already partitioned), `GatheredParameters` and external parameters.

Under `Init`, every module built is partitioned as its constructor returns: each of its parameters is
broadcast from rank 0 (so every rank starts from the same values, as DDP does), flattened, padded to a
multiple of the world size, and only this rank's slice is kept. So the whole model never exists on
one rank: at most its slices plus the one module being built. With ``remote_device="nvme"`` the
slices go to files under ``offload_param.nvme_path`` as they are made, so RAM holds only the module
being built (a model whose 1/N does not fit either). A module built on the meta device
(``torch.nn.utils.skip_init``) is partitioned when ``to_empty`` gives it memory, with the values it
left (uninitialised, as skip_init promises; rank 0's).

Devices, as DeepSpeed's: modules are built on the accelerator's current device
(``get_accelerator().current_device_name()``: the default device inside the block), one at a time, and
each is partitioned as its constructor returns, so a model larger than one device's memory is never
whole on it: the device holds the slices plus the module being built. The slices stay on the device
(``remote_device`` "none", the default), or go to the host (page-locked with ``pin_memory``) or NVMe;
the partitioned parameters' empty tensors are on the device. On the CPU accelerator all of it is
host memory, as before. `ZeroOptimizer` at stage 3 takes such
a model as it is (it gathers one unit at a time to lay out its partitions); below stage 3 it makes
the parameters whole first.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import threading
import uuid
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ds_comm
import ds_ops
from ds_io import AioConfig, TensorSwapper

from ._model import gather_init_partitioned, init_shard, is_init_partitioned
from ._nvme import check_nvme_path, remove_swap_directory
from ._params import ZeroParamStatus, give_id, set_shard, stage3_owner, units_of
from ._precision import DTYPES
from ._stage3 import EXTERNAL
from .config import BF16Config, FP16Config, ZeroConfig, mixed_precision

_lock = threading.Lock()
_active: list[ModulePartitioner] = []  # the partitioners of the Init contexts entered, innermost last
_originals: dict[type, Any] = {}  # classes whose __init__ is wrapped, and their own __init__
_building: dict[int, int] = {}  # id(module) -> depth of its constructors running (partition at depth 0)
_to_empty_hooks: weakref.WeakSet = weakref.WeakSet()  # the to_empty functions put on meta-built modules


class Init:
    """Partition every ``nn.Module`` built inside the ``with`` block across the data-parallel ranks::

        with ds_zero.Init(config_dict_or_path=ds_config):
            model = GPT()            # each rank holds 1/N of every parameter
        zero = ds_zero.ZeroOptimizer(model, ..., config=ds_config)   # stage 3

    DeepSpeed's arguments: ``module`` (an already built model to partition now), ``data_parallel_group``,
    ``mem_efficient_linear`` (accepted: stage 3 keeps no whole weight for any layer's backward, linear
    or not), ``remote_device`` ("cpu": the slices in CPU memory; "nvme": in files under the config's
    ``zero_optimization.offload_param.nvme_path``, through ds-io with the config's ``aio`` section;
    "none": on the accelerator's device, where the model is built; default: the config's
    ``offload_param.device``, else "none"), ``pin_memory`` (slices on the host page-locked; no effect
    without an accelerator), ``config_dict_or_path`` (or ``config``: the DeepSpeed config, for its fp16/bf16, offload_param
    and aio sections), ``enabled``, ``dtype`` (the parameters' dtype; default: bf16/fp16 from the
    config, else as built).
    """

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, **ignored: Any):
        unknown = sorted(k for k in ignored if k not in ("zero_param_parallel_group", "sequence_data_parallel_group",
                                                          "param_swapper", "zero_quantized_weights",
                                                          "zero_quantized_nontrainable_weights"))
        if unknown:
            raise TypeError(f"ds_zero.Init: unexpected keyword arguments {unknown}")
        for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
            if ignored.get(key):
                raise NotImplementedError(f"ds_zero.Init: {key} (ZeRO++) is not implemented in ds-zero")
        if remote_device not in (None, "cpu", "none", "nvme"):
            raise ValueError(f"ds_zero.Init: remote_device must be None, 'none' (the accelerator's device), 'cpu' or "
                             f"'nvme', got {remote_device!r}")
        if config is not None and config_dict_or_path is not None:
            raise ValueError("ds_zero.Init: give config_dict_or_path or config (its old name), not both")
        ds_config = _load(config_dict_or_path if config_dict_or_path is not None else config)
        self.enabled = bool(enabled)
        self.group = data_parallel_group if data_parallel_group is not None else (
            mpu.get_data_parallel_group() if mpu is not None else None)
        self.dtype = dtype if dtype is not None else _config_dtype(ds_config)
        if self.dtype is not None and not self.dtype.is_floating_point:
            raise ValueError(f"ds_zero.Init: dtype must be a floating-point dtype, got {self.dtype}")
        self.mem_efficient_linear = mem_efficient_linear
        if self.enabled and not ds_comm.is_initialized():  # DeepSpeed's Init starts it too (from the environment)
            ds_comm.init_distributed()
        offload = ZeroConfig.from_section_or_ds_config(ds_config).offload_param if ds_config is not None else None
        if remote_device is None:
            remote_device = offload.device if offload is not None else "none"
        self.remote_device = remote_device
        self.pin_memory = bool(pin_memory)
        self.device = torch.device(ds_ops.get_accelerator().current_device_name())  # where modules are built
        store = None  # _NvmeShards: where the slices go with remote_device "nvme"
        if self.remote_device == "nvme" and self.enabled:
            if offload is None or not offload.nvme_path:
                raise ValueError("ds_zero.Init: remote_device 'nvme' writes the parameters' slices under the config's "
                                 "zero_optimization.offload_param.nvme_path; give config_dict_or_path with "
                                 "offload_param: {device: nvme, nvme_path: ...}")
            store = _NvmeShards(offload.nvme_path, AioConfig.from_section_or_ds_config(ds_config), ds_comm.get_rank())
        self._partitioner = ModulePartitioner(
            group=self.group, device=self.device, dtype=self.dtype, store=store,
            # where the slices are kept: the device ("none"), else the host (NVMe: written from there)
            shard_device=self.device if remote_device == "none" else torch.device("cpu"),
            pin=self.pin_memory and remote_device == "cpu" and self.device.type != "cpu")
        if module is not None and self.enabled:
            for sub in module.modules():
                self._partitioner.partition(sub)
            if any(p.is_meta for p in module.parameters()):
                _partition_after_to_empty(module, self._partitioner)

    _store = property(lambda self: self._partitioner.store)  # read-only, for a test written against it

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        with _lock:
            if not _active:
                _wrap_every_module_class()
            _active.append(self._partitioner)
            # As DeepSpeed's Init, tensors are created in the 16-bit dtype: a layer's initial weights are
            # drawn in it (not drawn in float32 and rounded), so they are DeepSpeed's bit for bit.
            self._default_dtype = torch.get_default_dtype()
            if self.dtype in (torch.float16, torch.bfloat16):
                torch.set_default_dtype(self.dtype)
            # as DeepSpeed's Init: tensors are made on the accelerator's device (one module whole at a time)
            # (never set for the CPU: a default device is a torch-function mode every factory call goes through)
            self._default_device = torch.get_default_device()
            if self.device.type != "cpu":
                torch.set_default_device(self.device)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        with _lock:
            _active.remove(self._partitioner)
            torch.set_default_dtype(self._default_dtype)
            if self.device.type != "cpu":
                torch.set_default_device(None if self._default_device.type == "cpu" else self._default_device)
            if not _active:
                _unwrap_every_module_class()


class ModulePartitioner:
    """What `Init` does to each module built under it (or given to it): keep only this rank's slice of the
    module's own parameters. ``group``: the data-parallel group; ``device``: where each parameter is
    broadcast (and its empty tensor lives); ``dtype``: the parameters' dtype (None: as built);
    ``shard_device``: where the slices are kept, page-locked with ``pin``; ``store``: `_NvmeShards` for
    ``remote_device="nvme"``, else None."""

    def __init__(self, *, group: Any, device: torch.device, dtype: torch.dtype | None, shard_device: torch.device,
                 pin: bool, store: _NvmeShards | None):
        self.group, self.device, self.dtype = group, device, dtype
        self.shard_device, self.pin, self.store = shard_device, pin, store

    def partition(self, module: nn.Module) -> None:
        """Keep only this rank's slice of ``module``'s own parameters (not yet partitioned ones): each is
        broadcast on the device (a module given to ``Init(module=...)`` moves there one parameter at a
        time), and its slice kept where ``remote_device`` says."""
        world, rank = ds_comm.get_world_size(self.group), ds_comm.get_rank(self.group)
        source = ds_comm.get_global_rank(self.group, 0) if self.group is not None else 0
        for p in module.parameters(recurse=False):
            if is_init_partitioned(p) or stage3_owner(p) is not None or p.is_meta:  # meta: at to_empty (skip_init)
                continue
            data = p.data.to(self.device)
            if self.dtype is not None and data.is_floating_point():
                data = data.to(self.dtype)
            data = data.contiguous()
            ds_comm.broadcast(data, src=source, group=self.group)
            shard = -(-data.numel() // world)
            flat = data.reshape(-1)
            mine = torch.zeros(shard, dtype=data.dtype, device=self.shard_device)
            if self.pin:
                mine = ds_ops.get_accelerator().pin_memory(mine)
            lo, hi = min(rank * shard, flat.numel()), min((rank + 1) * shard, flat.numel())
            mine[:hi - lo].copy_(flat[lo:hi])
            p.ds_shape, p.ds_numel = data.shape, data.numel()
            del data, flat  # the whole parameter: gone before the next one is moved
            p.ds_init_group, p.ds_init_shard = self.group, True
            give_id(p)
            p.ds_status, p.ds_persist = ZeroParamStatus.NOT_AVAILABLE, False
            if self.store is not None:
                self.store.put(p, mine, self.device)
            else:  # as DeepSpeed's: the parameter empty (on the device), its shard in ds_tensor
                set_shard(p, mine)
                p.data = torch.empty(0, dtype=mine.dtype, device=self.device)


class _NvmeShards:
    """``Init(remote_device="nvme")``: each parameter's slice in a file of its own, from when it is
    built until `ZeroOptimizer` lays the slices out in its partition file (each file is removed
    then). The directory goes when this object does (or at exit)."""

    def __init__(self, nvme_path: str, aio: AioConfig, rank: int):
        self.root = check_nvme_path(nvme_path, 0, "ds_zero.Init(remote_device='nvme')")
        self.directory = self.root / f"ds_zero_init_rank{rank}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.swapper = TensorSwapper(self.directory, aio)
        self._finalizer = weakref.finalize(self, remove_swap_directory, self.swapper, self.directory)
        self._keys = 0
        self.bytes = 0  # on disk now

    def put(self, p: torch.Tensor, shard: torch.Tensor, device: torch.device) -> None:
        free = shutil.disk_usage(self.root).free
        if free < shard.nbytes:
            raise OSError(f"nvme_path '{self.root}' has {free} bytes free; ds_zero.Init(remote_device='nvme') needs "
                          f"{shard.nbytes} bytes more for a slice of a {tuple(p.ds_shape)} parameter: free space or "
                          "point offload_param.nvme_path elsewhere")
        key, self._keys = self._keys, self._keys + 1
        self.swapper.swap_out([shard], keys=[key]).wait()
        self.bytes += shard.nbytes
        p.ds_init_store, p.ds_init_key = self, key
        p.data = torch.empty(0, dtype=shard.dtype, device=device)
        set_shard(p, torch.empty(0, dtype=shard.dtype), shard.numel())  # DeepSpeed's placeholder: on NVMe
        p.ds_tensor.final_location = "nvme"

    def read(self, p: torch.Tensor) -> torch.Tensor:
        return self.swapper.swap_in([p.ds_init_key]).wait()[0]

    def write(self, p: torch.Tensor, shard: torch.Tensor) -> None:
        self.swapper.swap_out([shard.contiguous()], keys=[p.ds_init_key], offset=0).wait()

    def release(self, p: torch.Tensor) -> None:
        self.bytes -= self.swapper.path_of(p.ds_init_key).stat().st_size
        self.swapper.release([p.ds_init_key])


def _load(config: Any) -> dict | None:
    if config is None:
        return None
    if isinstance(config, (str, Path)):
        config = json.loads(Path(config).read_text())
    if not isinstance(config, dict):
        raise ValueError(f"ds_zero.Init: config_dict_or_path must be a dict or a JSON file's path, got "
                         f"{type(config).__name__}")
    return config


def _config_dtype(config: dict | None) -> torch.dtype | None:
    if config is None:
        return None
    precision = mixed_precision(FP16Config.from_section_or_ds_config(config),
                                BF16Config.from_section_or_ds_config(config))
    return None if precision == "fp32" else DTYPES[precision]


def _all_subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def _wrap(cls: type) -> None:
    original = cls.__dict__.get("__init__")
    if original is None or cls in _originals:
        return
    _originals[cls] = original

    @functools.wraps(original)
    def init(module, *args, **kwargs):
        key = id(module)
        _building[key] = _building.get(key, 0) + 1
        try:
            original(module, *args, **kwargs)
        finally:
            _building[key] -= 1
            if not _building[key]:
                del _building[key]
        if key not in _building and _active:  # the outermost constructor of this module returned
            _active[-1].partition(module)
            if any(p.is_meta for p in module.parameters()):
                _partition_after_to_empty(module, _active[-1])

    cls.__init__ = init


def _partition_after_to_empty(module: nn.Module, partitioner: ModulePartitioner) -> None:
    """A module built on the meta device (``torch.nn.utils.skip_init``: ``cls(..., device="meta")``, then
    ``to_empty``) is partitioned when ``to_empty`` gives its parameters memory, as DeepSpeed's Init does:
    with the values ``to_empty`` left (uninitialised; rank 0's, broadcast). The hook is on the instance
    and goes at that call (with those of its submodules: one partitioning covers them all)."""
    def to_empty(*args: Any, **kwargs: Any) -> nn.Module:
        for sub in module.modules():
            if sub.__dict__.get("to_empty") in _to_empty_hooks:
                del sub.__dict__["to_empty"]
        result = module.to_empty(*args, **kwargs)
        for sub in module.modules():
            partitioner.partition(sub)
        return result

    _to_empty_hooks.add(to_empty)
    module.__dict__["to_empty"] = to_empty


def _init_subclass(cls, **kwargs):
    super(nn.Module, cls).__init_subclass__(**kwargs)
    if _active:
        _wrap(cls)


def _wrap_every_module_class() -> None:
    for cls in {nn.Module, *_all_subclasses(nn.Module)}:
        _wrap(cls)
    nn.Module.__init_subclass__ = classmethod(_init_subclass)


def _unwrap_every_module_class() -> None:
    for cls, original in _originals.items():
        cls.__init__ = original
    _originals.clear()
    if "__init_subclass__" in nn.Module.__dict__:
        del nn.Module.__init_subclass__


@contextlib.contextmanager
def GatheredParameters(params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None,
                       fwd_module: nn.Module | None = None, enabled: bool = True) -> Iterator[None]:
    """Inside the block the partitioned ``params`` are whole on every rank (every rank must enter it).
    With ``modifier_rank``, what that rank wrote is broadcast on exit and partitioned again (the
    optimizer's master copy follows); without, changes are discarded. Whole parameters pass through."""
    if isinstance(params, torch.Tensor):
        params = [params]
    params = [p for p in params if p is not None]
    if modifier_rank is not None and (isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int)
                                      or modifier_rank < 0):
        raise ValueError(f"GatheredParameters: modifier_rank must be a rank (an int >= 0) or None, got "
                         f"{modifier_rank!r}")
    if not enabled:
        yield
        return
    owners = units_of(params)
    init_params = [p for p in params if is_init_partitioned(p)]
    devices = {p: p.device for p in init_params}  # of their empty tensors: the model's device
    shards = {}
    for stage3, units in owners.items():
        for unit in units:
            stage3.hold(unit)
    for p in init_params:
        shards[p] = init_shard(p)
        p.data = gather_init_partitioned(p).clone()
        p.ds_status = ZeroParamStatus.AVAILABLE
    try:
        yield
    finally:
        for stage3, units in owners.items():
            for unit in units:
                stage3.unhold(unit, modifier_rank)
        for p in init_params:
            group = p.ds_init_group
            if modifier_rank is not None:
                source = ds_comm.get_global_rank(group, modifier_rank) if group is not None else modifier_rank
                ds_comm.broadcast(p.data, src=source, group=group)
                flat, shard = p.data.reshape(-1), shards[p]
                rank = ds_comm.get_rank(group)
                lo, hi = min(rank * shard.numel(), flat.numel()), min((rank + 1) * shard.numel(), flat.numel())
                shard[:hi - lo].copy_(flat[lo:hi])
            store = getattr(p, "ds_init_store", None)
            if store is not None and modifier_rank is not None:  # the slice stays on NVMe
                store.write(p, shards[p])
            p.data = torch.empty(0, dtype=p.dtype, device=devices[p])
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Tell stage 3 that ``module``'s forward reads ``parameter`` of another module (a tied weight
    used through ``F.linear(x, other.weight)``): it is gathered with ``module``'s own."""
    if not isinstance(module, nn.Module) or not isinstance(parameter, torch.Tensor):
        raise ValueError(f"register_external_parameter(module, parameter): got {type(module).__name__}, "
                         f"{type(parameter).__name__}")
    external = module.__dict__.setdefault(EXTERNAL, [])
    if not any(p is parameter for p in external):
        external.append(parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo `register_external_parameter`."""
    external = module.__dict__.get(EXTERNAL, [])
    module.__dict__[EXTERNAL] = [p for p in external if p is not parameter]


__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter"]
