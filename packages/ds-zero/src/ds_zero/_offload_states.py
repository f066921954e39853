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
from collections.abc import Callable, Iterable, Iterator
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


class StateMover:
    """Moves ZeRO's states to the host and back (see the module docstring); it owns what it moved
    (``offloaded``: each offloaded state -> {id of each of its roots: the device it came from}). Its inputs:
    ``roots(state)``, the flat tensors holding a state (`state_roots`); ``views()``, every tensor that may be
    a view of one (`state_views`); ``movable``, the states that may move (`movable_states`);
    ``param_device``: ``offload_param.device`` (moving is refused with one); ``finish_in_flight``: completes
    the gradient reductions in flight (they write the states)."""

    def __init__(self, *, roots: Callable[[OffloadStateTypeEnum], list[torch.Tensor]],
                 views: Callable[[], Iterator[torch.Tensor]], movable: list[OffloadStateTypeEnum],
                 param_device: str | None, finish_in_flight: Callable[[], None]):
        self.roots, self.views, self.movable = roots, views, movable
        self.param_device, self.finish_in_flight = param_device, finish_in_flight
        self.offloaded: dict[OffloadStateTypeEnum, dict[int, torch.device]] = {}

    def check_can_move(self, call: str, *, closed: bool) -> None:
        if closed:
            raise RuntimeError(f"ZeroOptimizer.{call}: this optimizer was closed")
        if self.param_device is not None and self.param_device != "none":
            raise RuntimeError(f"ZeroOptimizer.{call}: the parameters are offloaded to {self.param_device} "
                               "(zero_optimization.offload_param); moving states is not supported with it (as in "
                               "DeepSpeed)")
        # reductions still in flight (between micro-steps at stages 2-3) finish first: they write the states
        self.finish_in_flight()

    def offload(self, include: Iterable[OffloadStateTypeEnum] | None, device: OffloadDeviceEnum, *, pin_memory: bool,
                non_blocking: bool, closed: bool) -> None:
        """See `ZeroOptimizer.offload_states`."""
        states = check_include(include)
        target = check_device(device)
        self.check_can_move("offload_states", closed=closed)
        if target == OffloadDeviceEnum.none:
            logger.warning("offload_states: device is 'none', nothing is moved")
            return
        if target == OffloadDeviceEnum.nvme:
            raise ValueError("offload_states: device 'nvme' is not supported (as in DeepSpeed); offload to 'cpu'")
        host = torch.device("cpu")
        # where each root came from, also when another state moved it (fp32: hp_params is lp_params' buffer)
        origins = {key: device for moved in self.offloaded.values() for key, device in moved.items()}
        views = list(self.views())
        for state in states:
            if state in self.offloaded or state not in self.movable:
                continue
            self.offloaded[state] = {}
            for root in self.roots(state):
                if id(root) not in origins:
                    origins[id(root)] = root.device
                    _move_root(root, host, views, pin_memory=pin_memory, non_blocking=non_blocking)
                self.offloaded[state][id(root)] = origins[id(root)]
        _finish_moves(non_blocking)

    def reload(self, *, non_blocking: bool, closed: bool) -> None:
        """See `ZeroOptimizer.reload_states`."""
        self.check_can_move("reload_states", closed=closed)
        views, done = list(self.views()), set()
        for state, origins in list(self.offloaded.items()):
            for root in self.roots(state):
                if id(root) not in done and id(root) in origins:
                    done.add(id(root))
                    _move_root(root, origins[id(root)], views, pin_memory=False, non_blocking=non_blocking)
            del self.offloaded[state]
        _finish_moves(non_blocking)


def movable_states(policy: Any) -> list[OffloadStateTypeEnum]:
    """The states ``offload_states`` may move under ``policy`` (a `ZeroPolicy`)."""
    states = list(OffloadStateTypeEnum)
    if policy.offload:  # the master copy and the optimizer step on the host (or NVMe) by design
        states = [s for s in states if s not in (OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states)]
        if policy.shard_params:
            states.remove(OffloadStateTypeEnum.lp_grads)
    return states


def state_roots(buffers: Any, optimizer: torch.optim.Optimizer, reduction_buffers: Callable[[], list[torch.Tensor]],
                state: OffloadStateTypeEnum) -> list[torch.Tensor]:
    """The flat tensors ZeRO owns that hold ``state`` (each a base tensor: views point into it), in ``buffers``
    (a `ZeroBuffers`), the `GradientReducer`'s ``reduction_buffers()`` and ``optimizer``'s state."""
    if state == OffloadStateTypeEnum.lp_params:
        roots = [buffers.flat]
    elif state == OffloadStateTypeEnum.hp_params:
        roots = [buffers.flat if buffers.master is None else buffers.master]
    elif state == OffloadStateTypeEnum.lp_grads:
        roots = [buffers.grads, buffers.partition, buffers.master_grads]
    elif state == OffloadStateTypeEnum.contiguous_grad_buffer:
        roots = reduction_buffers()
    else:
        roots = [value for per_tensor in optimizer.state.values() for key, value in per_tensor.items()
                 if torch.is_tensor(value) and key != "step"]
    return [root for root in roots if root is not None]


def state_views(buffers: Any, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every tensor object that may be a view of a root: the parameters and their gradients, the
    tensors the optimizer steps and theirs, ZeRO's per-bucket and per-run slices, stage 3's partition,
    the optimizer's state tensors."""
    seen: set[int] = set()
    params, step_params = buffers.params, buffers.step_params
    candidates = [*params, *step_params, *buffers.shard_grads, *buffers.step_grads,
                  *(buffers.copies or []), *(per_tensor.get(key) for per_tensor in optimizer.state.values()
                                             for key in per_tensor)]
    candidates += [t.grad for t in [*params, *step_params]]
    if buffers.host is not None:  # ZeRO-Offload copies from and into these slices of the device buffers
        candidates += [*buffers.host.device_grads, *buffers.host.device_params]
    if buffers.stage3 is not None:
        candidates.append(buffers.stage3.partition)
    for tensor in candidates:
        if torch.is_tensor(tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor


def _finish_moves(non_blocking: bool) -> None:
    accelerator = ds_ops.get_accelerator()
    if not non_blocking:
        accelerator.synchronize()
    accelerator.empty_cache()
