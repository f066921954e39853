"""DeepSpeed's state-access API (``deepspeed.utils.safe_get_full_fp32_param`` and its family) over a
`ZeroOptimizer`: read and write one parameter's float32 master weights, its gradient and its optimizer
states, whole or this rank's part, wherever ZeRO keeps them (the flat buffer, the master copy, the
partition, the optimizer's states, NVMe files).

Each parameter a `ZeroOptimizer` trains carries a weak reference back to it (`link_parameters`); a tensor
without one (a frozen parameter, a plain tensor) is not ZeRO's: the getters return None and the setters do
nothing, as DeepSpeed's do. As in DeepSpeed:

* ``safe_get_full_*`` assemble the whole tensor from every rank's piece with an all-reduce over the
  data-parallel group: every rank calls them, for the same parameters in the same order. They return new
  float32 tensors of the parameter's shape.
* gradients exist from a backward until the step: the reduced gradient (averaged over the ranks, each
  micro-step's divided by ``gradient_accumulation_steps``, times the loss scale with fp16) accumulated so
  far; at stages 0-1 between accumulation boundaries, where nothing is reduced yet, this rank's own.
* the ``safe_*_local_*`` variants are for ZeRO-3 partitioned parameters: this rank's piece of the
  parameter (as many elements as ``param.ds_tensor``), no collective.
* ``optim_state_key`` names a per-element state of the optimizer (``"exp_avg"``, ``"exp_avg_sq"`` for
  Adam); ``"step"`` is a scalar, not a parameter's state, and is refused as DeepSpeed refuses it.

Unlike DeepSpeed's, a ``safe_set_*_fp32_param`` writes the model's (16-bit) weight too, so the next forward
uses the new value (DeepSpeed's model keeps the old one until the next step; see the README).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

import ds_comm

from ._nvme import STATES
from ._records import ParamRecord, Range

if TYPE_CHECKING:
    from ._optimizer import ZeroOptimizer

_LINK = "_ds_zero_optimizer"  # the attribute a trained parameter carries: a weak reference to its optimizer


def link_parameters(zero: ZeroOptimizer) -> None:
    """Point each parameter ``zero`` trains back at it (weakly: the parameter does not keep it alive)."""
    ref = weakref.ref(zero)
    for record in zero.internals.records:
        setattr(record.param, _LINK, ref)


def _owner(param: Any) -> tuple[ZeroOptimizer, ParamRecord] | None:
    """The live optimizer training ``param`` and the parameter's record in it, or None."""
    ref = getattr(param, _LINK, None)
    zero = ref() if ref is not None else None
    if zero is None or zero.internals.closed:
        return None
    record = zero.internals.records.of(param)
    return None if record is None else (zero, record)


def _value(what: str, value: Any, numel: int, name: str) -> torch.Tensor:
    if not torch.is_tensor(value):
        raise ValueError(f"{what}: value must be a tensor, got {type(value).__name__}")
    if value.numel() != numel:
        raise ValueError(f"{what}: value has {value.numel()} elements ({tuple(value.shape)}), {name} has {numel}")
    return value.detach().reshape(-1)


def _local_owner(what: str, param: Any) -> tuple[ZeroOptimizer, int] | None:
    owner = _owner(param)
    if owner is None:
        if hasattr(param, "ds_id"):  # a ZeRO-3 parameter ZeRO does not train (frozen): DeepSpeed's None
            return None
        raise ValueError(f"{what} is defined for ZeRO-3 partitioned parameters; this tensor is not one")
    if not owner[0].policy.shard_params:
        raise ValueError(f"{what} is defined for ZeRO-3 partitioned parameters; this parameter's optimizer runs "
                         f"zero_optimization.stage {owner[0].stage}: use the safe_get_full_*/safe_set_full_* form")
    return owner


def _assemble(zero: ZeroOptimizer, record: ParamRecord, piece: torch.Tensor | None) -> torch.Tensor:
    """The whole parameter-shaped float32 tensor from every rank's ``piece`` (an all-reduce of disjoint parts)."""
    slot, where = record.slot, record.held
    if not zero.policy.shard_optimizer:
        return _on_device(zero, piece).view(slot.shape)
    out = torch.zeros(slot.numel, dtype=torch.float32, device=zero.device)
    if where.numel:
        out[where.param_offset:where.param_offset + where.numel].copy_(piece)
    ds_comm.all_reduce(out, group=record.group)  # the ranks holding it (`_replicas`)
    return out.view(slot.shape)


def _on_device(zero: ZeroOptimizer, piece: torch.Tensor) -> torch.Tensor:
    """A float32 copy of ``piece`` on the model's device (pieces ZeRO-Offload keeps on the host come back there)."""
    return piece.to(device=zero.device, dtype=torch.float32, copy=True)


# ------------------------------------------------------------------------------------------- master weights
def _master_kind(zero: ZeroOptimizer) -> str | None:
    """Where the master copy is on NVMe ("master": its own file, "param": the float32 parameters' file), or None."""
    nvme = zero.internals.nvme
    if nvme is None:
        return None
    return "master" if nvme.master else ("param" if nvme.param_dtype is not None else None)


def _read_master(zero: ZeroOptimizer, where: Range) -> torch.Tensor:
    kind, nvme = _master_kind(zero), zero.internals.nvme
    if kind is not None:
        dtype = torch.float32 if kind == "master" else nvme.param_dtype
        return nvme.read_range(kind, where.in_partition, torch.empty(where.numel, dtype=dtype, device="cpu")).float()
    return zero.internals.master[where.in_master:where.in_master + where.numel].float()


def _write_master(zero: ZeroOptimizer, where: Range, values: torch.Tensor) -> None:
    kind, nvme = _master_kind(zero), zero.internals.nvme
    if kind is not None:
        dtype = torch.float32 if kind == "master" else nvme.param_dtype
        nvme.write_range(kind, where.in_partition, values.to(dtype))
        return
    zero.internals.master[where.in_master:where.in_master + where.numel].copy_(values)


def _write_shard(zero: ZeroOptimizer, where: Range, values: torch.Tensor) -> None:
    """Stage 3: this rank's 16-bit shard of a parameter follows new master values (in the parameters' file
    on NVMe, unless that file is the master copy, written already)."""
    nvme = zero.internals.nvme
    if nvme is not None and nvme.param_dtype is not None:  # the shard is in the parameters' file
        if _master_kind(zero) != "param":
            nvme.write_range("param", where.in_partition, values.to(nvme.param_dtype))
    else:
        zero.internals.flat[where.in_partition:where.in_partition + where.numel].copy_(values)


def _write_model(zero: ZeroOptimizer, record: ParamRecord, whole: torch.Tensor) -> None:
    """The model's (16-bit) weight follows a new master value: below stage 3 the parameter itself (a view of
    the flat buffer, whole on every rank); at stage 3 this rank's shard, and the parameter if it is gathered."""
    param, where = record.param, record.held
    if not zero.policy.shard_params:
        param.data.copy_(whole.view(param.shape))
        return
    if where.numel:
        _write_shard(zero, where, whole[where.param_offset:where.param_offset + where.numel])
    if param.numel() == whole.numel():  # gathered now (persistent, held, in use): whole on every rank
        param.data.copy_(whole.view(param.shape))


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole float32 master weights of ``param`` (a collective: every rank calls it); None when ZeRO
    does not train it."""
    owner = _owner(param)
    if owner is None:
        return None
    zero, record = owner
    return _assemble(zero, record, _read_master(zero, record.held) if record.held.numel else None)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``param``'s float32 master weights (each rank writes its piece of ``value``, the whole new value)
    and the model's weight; the next forward uses it and the next step starts from it. No collective."""
    owner = _owner(param)
    if owner is None:
        return
    zero, record = owner
    whole = _value("safe_set_full_fp32_param", value, record.slot.numel, "the parameter")
    where = record.held
    if where.numel:
        _write_master(zero, where, whole[where.param_offset:where.param_offset + where.numel].float())
    _write_model(zero, record, whole)


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of a ZeRO-3 parameter's float32 master weights (a flat copy, maybe empty)."""
    owner = _local_owner("safe_get_local_fp32_param", param)
    if owner is None:
        return None
    zero, where = owner[0], owner[1].held
    return _on_device(zero, _read_master(zero, where)) if where.numel else torch.zeros(0, device=zero.device)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's piece of a ZeRO-3 parameter's float32 master weights (``value``: as many elements as
    ``param.ds_tensor``) and of its 16-bit shard; the parameter, if gathered now, keeps its value until the
    next gather (the other ranks' pieces may change too)."""
    owner = _local_owner("safe_set_local_fp32_param", param)
    if owner is None:
        return
    zero, where = owner[0], owner[1].held
    values = _value("safe_set_local_fp32_param", value, where.numel, "this rank's piece of the parameter")
    if where.numel:
        _write_master(zero, where, values.float())
        _write_shard(zero, where, values)


# ----------------------------------------------------------------------------------------- optimizer states
def _state(zero: ZeroOptimizer, where: Range, key: Any, what: str) -> torch.Tensor | None:
    """A view of this rank's piece of state ``key`` (a float32 copy for states on NVMe); None: no piece here."""
    nvme, tensors = zero.internals.nvme, zero.internals.step_tensors
    if nvme is not None:
        if key not in STATES:
            raise ValueError(f"{what}: optim_state_key must be one of {list(STATES)} (the per-element states of "
                             f"ZeRO-Infinity's Adam), got {key!r}")
        if not where.numel:
            return None
        return nvme.read_range(key, where.in_partition, torch.empty(where.numel, dtype=torch.float32, device="cpu"))
    sample = next((t for t in tensors if zero.optimizer.state.get(t)), None)
    if sample is None:
        raise RuntimeError(f"{what}: the optimizer has no state yet; it makes its states at its first step")
    per_element = sorted(k for k, v in zero.optimizer.state[sample].items()
                         if torch.is_tensor(v) and v.dim() > 0 and v.numel() == sample.numel())
    if key not in per_element:
        raise ValueError(f"{what}: optim_state_key must name a per-element state of {type(zero.optimizer).__name__}, "
                         f"one of {per_element}; got {key!r}")
    if not where.numel:
        return None
    return zero.optimizer.state[tensors[where.run]][key][where.in_run:where.in_run + where.numel]


def _write_state(zero: ZeroOptimizer, where: Range, key: str, values: torch.Tensor, what: str) -> None:
    target = _state(zero, where, key, what)
    if target is None:
        return
    if zero.internals.nvme is not None:
        zero.internals.nvme.write_range(key, where.in_partition, values.float())
    else:
        target.copy_(values)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The whole float32 optimizer state ``optim_state_key`` ("exp_avg", "exp_avg_sq") of ``param`` (a
    collective); None when ZeRO does not train it."""
    owner = _owner(param)
    if owner is None:
        return None
    zero, record = owner
    piece = _state(zero, record.held, optim_state_key, "safe_get_full_optimizer_state")
    return _assemble(zero, record, piece.float() if piece is not None else None)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set ``param``'s optimizer state ``optim_state_key`` to ``value`` (the whole tensor; each rank writes
    its piece). No collective."""
    owner = _owner(param)
    if owner is None:
        return
    zero, record = owner
    whole = _value("safe_set_full_optimizer_state", value, record.slot.numel, "the parameter")
    where = record.held
    _write_state(zero, where, optim_state_key, whole[where.param_offset:where.param_offset + where.numel],
                 "safe_set_full_optimizer_state")


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """This rank's piece of a ZeRO-3 parameter's optimizer state ``optim_state_key`` (a float32 copy)."""
    owner = _local_owner("safe_get_local_optimizer_state", param)
    if owner is None:
        return None
    zero = owner[0]
    piece = _state(zero, owner[1].held, optim_state_key, "safe_get_local_optimizer_state")
    return _on_device(zero, piece) if piece is not None else torch.zeros(0, device=zero.device)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's piece of a ZeRO-3 parameter's optimizer state ``optim_state_key``."""
    owner = _local_owner("safe_set_local_optimizer_state", param)
    if owner is None:
        return
    where = owner[1].held
    values = _value("safe_set_local_optimizer_state", value, where.numel, "this rank's piece of the parameter")
    _write_state(owner[0], where, optim_state_key, values, "safe_set_local_optimizer_state")


# ------------------------------------------------------------------------------------------------ gradients
def _gradient(zero: ZeroOptimizer, record: ParamRecord, what: str) -> tuple[torch.Tensor, bool]:
    """``(tensor, whole)``: the parameter's whole gradient (stage 0; stage 1 before its reduction: this rank's
    own) or this rank's reduced piece of it, as ZeRO holds it now."""
    internals = zero.internals
    if not internals.accumulated:
        raise RuntimeError(f"{what}: gradients are available after a backward and before the step (DeepSpeed: "
                           "'immediately after backward and before engine step'); none is held now")
    internals.wait_reductions()
    policy = zero.policy
    if not policy.shard_optimizer or (policy.reduces_whole_accumulation and not internals.boundary_reduced):
        return internals.grad_buffer[record.slot.offset:][:record.param.numel()], True
    where = record.held  # stages 1-3: this rank's reduced piece, in the partition
    return internals.grad_partition[where.in_partition:where.in_partition + where.numel], False


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole float32 gradient of ``param`` ZeRO holds between a backward and the step (a collective at
    stages 1-3); for a tensor ZeRO does not train, its ``.grad``."""
    owner = _owner(param)
    if owner is None:
        return param.grad
    zero, record = owner
    grad, whole = _gradient(zero, record, "safe_get_full_grad")
    if whole:
        return grad.float().clone().view(record.slot.shape)
    return _assemble(zero, record, grad.float())


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the gradient of ``param`` the next step uses (``value``: the whole gradient, in the held gradient's
    scale: times the loss scale with fp16). No collective."""
    owner = _owner(param)
    if owner is None:
        if param.grad is not None:
            param.grad.copy_(value)
        return
    zero, record = owner
    whole = _value("safe_set_full_grad", value, record.slot.numel, "the parameter")
    grad, is_whole = _gradient(zero, record, "safe_set_full_grad")
    zero.internals.gradients_changed()
    if is_whole:  # stage 0, or stage 1 before its reduction: the whole gradient
        grad.copy_(whole)
        return
    where = record.held
    grad.copy_(whole[where.param_offset:where.param_offset + where.numel])


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of a ZeRO-3 parameter's reduced gradient (a float32 copy)."""
    owner = _local_owner("safe_get_local_grad", param)
    if owner is None:
        return None
    grad, _ = _gradient(*owner, "safe_get_local_grad")
    return grad.float().clone()


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's piece of a ZeRO-3 parameter's reduced gradient."""
    owner = _local_owner("safe_set_local_grad", param)
    if owner is None:
        return
    grad, _ = _gradient(*owner, "safe_set_local_grad")
    owner[0].internals.gradients_changed()
    grad.copy_(_value("safe_set_local_grad", value, grad.numel(), "this rank's piece of the parameter"))


def safe_update_full_grad_vectorized(param_list: list[torch.Tensor], update_func: Callable) -> None:
    """``update_func(gradient, param)`` applied to each parameter's whole gradient, the result written back
    (every rank calls it with the same list: ZeRO's gradients are gathered, a collective)."""
    for p in param_list:
        if _owner(p) is None:
            if p.grad is not None:
                p.grad.copy_(update_func(p.grad, p))
        else:
            safe_set_full_grad(p, update_func(safe_get_full_grad(p), p))
