"""`ZeroOptimizer.offload_states` / `reload_states`: move ZeRO's training states to the host and back
between steps (DeepSpeed's engine methods of the same names, for RLHF-style loops that free the
accelerator for another model a while).

Each state is a few flat tensors ZeRO owns (its "roots"); the model's parameters, their gradients and
the optimizer's tensors are views of them. Moving a root copies it to the target device (into pinned
host memory with ``pin_memory``) and re-points every view of it at the copy in place (``tensor.data``),
so the objects the model, the optimizer and its schedule hold stay the same ones. A root already on
the target device is left where it is: on a CPU-only machine every state is there already and both
calls move nothing. `reload_states` moves each offloaded root back to the device it came from.

What each of DeepSpeed's `OffloadStateTypeEnum` names here:

* ``lp_params``: the flat buffer of the model's parameters (16-bit with fp16/bf16; at stage 3 this rank's
  partition of it);
* ``hp_params``: the float32 master copy (16-bit models); in float32 the parameters are their own master
  copy, so this is the ``lp_params`` buffer;
* ``lp_grads``: the flat gradients (stages 0-1), or this rank's gradient partition (stages 2-3), and the
  float32 gradients of a non-Adam optimizer of a 16-bit model;
* ``contiguous_grad_buffer``: the reduction's bucket and receive buffers;
* ``optim_states``: the optimizer's tensors (Adam's moments, ...), its ``step`` counters left where they are.

With ``offload_optimizer`` (cpu or nvme) the master copy and the optimizer's states live on the host (or
NVMe) by design and are not moved, nor, at stage 3, the gradient partition (DeepSpeed excludes the same).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

import ds_ops

from .config import OffloadDeviceEnum, OffloadStateTypeEnum

logger = logging.getLogger("ds_zero._optimizer")

_ALLOWED = ", ".join(s.value for s in OffloadStateTypeEnum)


def check_include(include: Any) -> list[OffloadStateTypeEnum]:
    """``include`` as a list of states (every state for None); a value that names none is a ValueError."""
    if include is None:
        return list(OffloadStateTypeEnum)
    if isinstance(include, (str, bytes)) or not isinstance(include, Iterable):
        raise ValueError(f"offload_states: include must be a collection of OffloadStateTypeEnum values ({_ALLOWED}) "
                         f"or None for all of them, got {include!r}")
    states = []
    for value in include:
        try:
            states.append(OffloadStateTypeEnum(value))
        except (ValueError, TypeError):
            raise ValueError(f"offload_states: include holds {value!r}, which is not a state; allowed: "
                             f"{_ALLOWED} (ds_zero.OffloadStateTypeEnum)") from None
    return states


def check_device(device: Any) -> OffloadDeviceEnum:
    try:
        return OffloadDeviceEnum(device)
    except (ValueError, TypeError):
        raise ValueError(f"offload_states: device must be an OffloadDeviceEnum (cpu; none does nothing), got "
                         f"{device!r}") from None


def _copy(tensor: torch.Tensor, device: torch.device, pin_memory: bool, non_blocking: bool) -> torch.Tensor:
    """A copy of ``tensor`` on ``device`` (page-locked when it is the host and ``pin_memory``)."""
    if device.type == "cpu" and pin_memory:
        out = ds_ops.get_accelerator().pin_memory(torch.empty_like(tensor, device=device))
        out.copy_(tensor, non_blocking=non_blocking)
        return out
    return tensor.to(device, non_blocking=non_blocking, copy=True)


def _move_root(root: torch.Tensor, device: torch.device, views: list[torch.Tensor], *, pin_memory: bool,
               non_blocking: bool, force: bool = False) -> bool:
    """Move ``root`` to ``device`` and re-point each of ``views`` that shares its memory at the copy (in
    place: the tensor objects stay the same). Nothing when it is there already (``force``: copy anyway,
    the tests' way of running the re-pointing on one device). Returns whether it moved."""
    if root.numel() == 0 or (root.device == device and not force):
        return False
    old, base = root.untyped_storage().data_ptr(), root.storage_offset()
    moved = _copy(root, device, pin_memory, non_blocking)
    for view in views:
        if view is not root and view.numel() and view.device == root.device \
                and view.untyped_storage().data_ptr() == old:
            view.data = moved.as_strided(view.size(), view.stride(), view.storage_offset() - base)
    root.data = moved
    return True


class OffloadStates:
    """The offload half of `ZeroOptimizer` (see the module docstring). A mixin: `ZeroOptimizer` owns the
    state (``self._offloaded``: each offloaded state -> {id of each of its roots: the device it came from})."""

    def offload_states(self, include: Iterable[OffloadStateTypeEnum] | None = None,
                       device: OffloadDeviceEnum = OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move the states in ``include`` (default: all; see `OffloadStateTypeEnum`) to ``device`` (the
        host: ``OffloadDeviceEnum.cpu``; ``none`` does nothing, ``nvme`` is refused, as in DeepSpeed), into
        pinned memory with ``pin_memory``. Call it between (micro-)steps; `reload_states`
        brings them back. A state already offloaded, or already on the host, is not moved again. Gradient
        reductions still in flight (stages 2-3 between micro-steps) are completed first."""
        states = check_include(include)
        target = check_device(device)
        self._check_can_move("offload_states")
        if target == OffloadDeviceEnum.none:
            logger.warning("offload_states: device is 'none', nothing is moved")
            return
        if target == OffloadDeviceEnum.nvme:
            raise ValueError("offload_states: device 'nvme' is not supported (as in DeepSpeed); offload to 'cpu'")
        host = torch.device("cpu")
        # where each root came from, also when another state moved it (fp32: hp_params is lp_params' buffer)
        origins = {key: device for moved in self._offloaded.values() for key, device in moved.items()}
        views = list(self._views())
        for state in states:
            if state in self._offloaded or state not in self._movable_states():
                continue
            self._offloaded[state] = {}
            for root in self._roots(state):
                if id(root) not in origins:
                    origins[id(root)] = root.device
                    _move_root(root, host, views, pin_memory=pin_memory, non_blocking=non_blocking)
                self._offloaded[state][id(root)] = origins[id(root)]
        self._finish_moves(non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Move every state `offload_states` moved back to the device it came from."""
        self._check_can_move("reload_states")
        views, done = list(self._views()), set()
        for state, origins in list(self._offloaded.items()):
            for root in self._roots(state):
                if id(root) not in done and id(root) in origins:
                    done.add(id(root))
                    _move_root(root, origins[id(root)], views, pin_memory=False, non_blocking=non_blocking)
            del self._offloaded[state]
        self._finish_moves(non_blocking)

    @property
    def offloaded_states(self) -> set[OffloadStateTypeEnum]:
        """The states `offload_states` moved and `reload_states` has not brought back."""
        return set(self._offloaded)

    # ------------------------------------------------------------------------------------ internals
    def _check_can_move(self, call: str) -> None:
        if self._closed:
            raise RuntimeError(f"ZeroOptimizer.{call}: this optimizer was closed")
        param = self.config.offload_param
        if param is not None and param.device != "none":
            raise RuntimeError(f"ZeroOptimizer.{call}: the parameters are offloaded to {param.device} "
                               "(zero_optimization.offload_param); moving states is not supported with it (as in "
                               "DeepSpeed)")
        # reductions still in flight (between micro-steps at stages 2-3) finish first: they write the states
        self._reducer.finish_in_flight()

    def _movable_states(self) -> list[OffloadStateTypeEnum]:
        states = list(OffloadStateTypeEnum)
        if self.offload:  # the master copy and the optimizer step on the host (or NVMe) by design
            states = [s for s in states if s not in (OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states)]
            if self.policy.shard_params:
                states.remove(OffloadStateTypeEnum.lp_grads)
        return states

    def _roots(self, state: OffloadStateTypeEnum) -> list[torch.Tensor]:
        """The flat tensors ZeRO owns that hold ``state`` (each a base tensor: views point into it)."""
        if state == OffloadStateTypeEnum.lp_params:
            roots = [self._flat]
        elif state == OffloadStateTypeEnum.hp_params:
            roots = [self._flat if self._master is None else self._master]
        elif state == OffloadStateTypeEnum.lp_grads:
            roots = [self._grads, self._partition, self._master_grads]
        elif state == OffloadStateTypeEnum.contiguous_grad_buffer:
            roots = [*self._reducer.bucket_buffers, *self._reducer.received]
        else:
            roots = [value for per_tensor in self.optimizer.state.values() for key, value in per_tensor.items()
                     if torch.is_tensor(value) and key != "step"]
        return [root for root in roots if root is not None]

    def _views(self) -> Iterator[torch.Tensor]:
        """Every tensor object that may be a view of a root: the parameters and their gradients, the
        tensors the optimizer steps and theirs, ZeRO's per-bucket and per-run slices, stage 3's partition,
        the optimizer's state tensors."""
        seen: set[int] = set()
        candidates = [*self._params, *self._step_params, *self._shard_grads, *self._step_grads,
                      *(self._copies or []), *(per_tensor.get(key) for per_tensor in self.optimizer.state.values()
                                               for key in per_tensor)]
        candidates += [t.grad for t in [*self._params, *self._step_params]]
        if self._host is not None:  # ZeRO-Offload copies from and into these slices of the device buffers
            candidates += [*self._host.device_grads, *self._host.device_params]
        if self._stage3 is not None:
            candidates.append(self._stage3.partition)
        for tensor in candidates:
            if torch.is_tensor(tensor) and id(tensor) not in seen:
                seen.add(id(tensor))
                yield tensor

    def _finish_moves(self, non_blocking: bool) -> None:
        accelerator = ds_ops.get_accelerator()
        if not non_blocking:
            accelerator.synchronize()
        accelerator.empty_cache()
