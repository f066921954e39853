"""`ZeroOptimizer`: ZeRO stages 0-3 over a model and an optimizer class, in a plain training loop.

The model's trainable parameters become views of one flat buffer laid out by `FlatLayout` (buckets
in backward order, each split evenly into one shard per rank). As backward produces gradients
(post-accumulate-grad hooks), each complete bucket is reduced at once, asynchronously, so reduction
overlaps the rest of backward:

* stage 0: gradients accumulate in a flat buffer; at the accumulation boundary each bucket is
  multiplied by 1/world_size and all-reduced (DDP's arithmetic, so the result is DDP's bit for bit);
  the optimizer steps every element.
* stage 1: gradients accumulate in the flat buffer as at stage 0; at the boundary each bucket is copied
  (times 1/world_size) into a bucket buffer and reduce-scattered into this rank's gradient partition, so
  ``.grad`` keeps the local accumulation and a second backward before the step is averaged whole again; the
  optimizer steps only this rank's shard of each bucket (its states exist for that shard only), and the
  updated shards are all-gathered back into the parameters.
* stage 2: each micro-step, a complete bucket's gradients are copied into a reusable bucket buffer
  (times 1/world_size) and reduce-scattered into this rank's flat gradient partition; the full-size
  gradients are freed at once. Optimizer and gather as in stage 1.
* stage 3: each bucket is one module's parameters (a fetch unit) and the flat buffer is only this
  rank's partition; `Stage3` gathers a unit around its module's forward and backward and releases
  it after. Gradients as at stage 2; after the step nothing is gathered (the next forward does).

The optimizer is the caller's class (``torch.optim.AdamW``, ``ds_ops.CPUAdam``, any optimizer whose
update is elementwise), built over one tensor per bucket (per run of one parameter group when the
groups have options of their own): in float32, views of the flat buffer, so stepping them updates
the model. 1-bit optimizers (`ds_zero.onebit`, stage 0) decide per step whether ZeRO averages the
gradients. With fp16/bf16 the flat buffer (and so the model) is 16-bit and the
optimizer is built over a float32 master copy of the part this rank steps (all of it at stage 0);
Adam-family optimizers are then stepped in one fused pass that also writes the new 16-bit
parameters (`_precision`), others on float32 copies of the gradients. fp16 scales the loss
(`LossScaler`) and skips the step on every rank when any gradient overflowed. ZeRO-Offload
(``offload_optimizer.device: cpu``) steps the master partition with ds-ops' CPU Adam on the host, whatever
the model's device (`_offload`: gradients copied down as their reductions land, parameters copied up).
``bf16.bf16_master_weights_and_grads`` (stages 1-3) keeps no float32 copy: as in float32 the
optimizer steps views of the flat (bf16) buffer with the bf16 gradients, its states in bf16
(``bf16.bf16_optimizer_states``) or, under ZeRO-Offload, in float32 kept by ds-ops' CPU Adam.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

import ds_comm

from ._buffers import ZeroBuffers
from ._collectives import grad_norm
from ._compressed import CompressedOptimizer
from ._counters import LoopCounters
from ._engine_calls import check_accumulation_steps, empty_partition_cache, grouped, refresh_master
from ._filling import check_optimizer
from ._grad_slots import GradientSlots
from ._groups import mask_padding
from ._internals import OptimizerInternals, ZeroInternals
from ._master import MasterStep, master_step
from ._model import checked_renames, model_device, version
from ._offload_states import StateMover, movable_states, state_roots, state_views
from ._policy import ZeroPolicy, resolve
from ._precision import check_bf16_master_optimizer
from ._reduction import GradientReducer
from ._replicas import adopt_model, check_model_parallel, trained_params
from ._scaler import LossScaler
from ._sharded import full_state_dict
from ._state import identity, load_rank_state, memory_bytes, needs_refresh, rank_state
from ._state_access import link_parameters
from ._zenflow import ZenFlow, master_from_model
from .config import OffloadDeviceEnum, OffloadStateTypeEnum

logger = logging.getLogger(__name__)


class ZeroOptimizer:
    """ZeRO stages 0-3 for ``model`` with ``optimizer`` (a class or a callable taking the list of
    tensors to optimize), in a plain loop::

        zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={"lr": 1e-3},
                             config={"stage": 2, "reduce_bucket_size": 5e8}, bf16={"enabled": True})
        for batch in batches:
            zero.backward(loss_fn(model(batch)))
            zero.step()          # True when the optimizer stepped (at each accumulation boundary)
            zero.zero_grad()

    ``config``: the ``zero_optimization`` section (a `ZeroConfig`, a dict, or a whole DeepSpeed
    config); ``fp16``/``bf16``: those sections (or the whole config). With either enabled the model's
    floating-point parameters and buffers become 16-bit and a float32 master copy is stepped (none with
    ``bf16.bf16_master_weights_and_grads``: the bf16 partition is stepped).
    ``gradient_clipping``: the global gradient norm's maximum (0: off).
    ``gradient_accumulation_steps``: micro-steps per optimizer step; ``backward`` divides the loss by
    it, as DeepSpeed's engine does. ``communication_data_type``: the dtype gradients are reduced in
    ("fp32", "fp16", "bf16"; default: float32 for bf16, else the gradients' dtype). ``group``: the
    data-parallel process group (default: all ranks). ``aio``: the ``aio`` section (or the whole
    config) for ``offload_optimizer.device: nvme``.
    ``param_groups``: the model's trainable parameters in groups with options of their own, as a
    torch optimizer takes them (``[{"params": decay, "weight_decay": 0.1}, {"params": no_decay,
    "weight_decay": 0.0}]``); ``optimizer`` is then called with the same groups over ZeRO's tensors
    (each bucket's stepped range split where the group changes), and the groups' options override
    ``optimizer_kwargs``. A group may name the ``process_group`` its parameters are replicated over (a
    subgroup of ``group`` holding this rank: MoE experts' expert-data-parallel group; stages 0-2): their
    gradients are reduced over it only, averaged by ``group``'s size, their buckets split over it
    (`_replicas`). ``checkpoint_names``: other names for some parameters or buffers in
    checkpoints (``{name in the model: name in the checkpoint}``), where the model's own would mean another
    tensor elsewhere (a pipeline stage's copy of a tied module's untied parameters, a rank's local expert).
    ``model_parallel_group``: the ranks holding the model's other parts (pipeline stages, tensor-parallel
    slices), whose gradients count in the norm clipped. ``tensor_parallel_rank``: this rank's place in the
    tensor-parallel dimension of that group: a parameter without Megatron's ``tensor_model_parallel`` mark is
    the same on every tensor-parallel rank and counts in the norm only where it is 0 (DeepSpeed's rule).
    ``gradient_averaging_size``: what the gradients summed over ``group`` are divided by (default: its size);
    DeepSpeed's sequence parallelism reduces over data × sequence ranks and divides by the data-parallel size.
    """

    def __init__(self, model: nn.Module, optimizer: type[torch.optim.Optimizer] | Callable = torch.optim.AdamW, *,
                 optimizer_kwargs: dict[str, Any] | None = None, config: Any = None, fp16: Any = None,
                 bf16: Any = None, gradient_clipping: float = 0.0, gradient_accumulation_steps: int = 1,
                 communication_data_type: Any = None, group: Any = None, aio: Any = None,
                 reduce_in_backward: bool = True, param_groups: Any = None,
                 checkpoint_names: dict[str, str] | None = None, model_parallel_group: Any = None,
                 tensor_parallel_rank: int = 0, gradient_averaging_size: int | None = None):
        policy, self.config, fp16_config, gradient_accumulation_steps = resolve(
            model, optimizer, config, fp16, bf16, communication_data_type, gradient_clipping,
            gradient_accumulation_steps, reduce_in_backward)
        renames = checked_renames(model, checkpoint_names)
        self.policy: ZeroPolicy = policy
        self.precision, self.dtype = policy.precision, policy.dtype
        self.communication_data_type = policy.communication_dtype
        self.reduce_in_backward = policy.reduce_in_backward
        params, group_of, group_options, process_groups = trained_params(model, param_groups, policy)
        self.device = model_device(model, params)  # every buffer below is made there
        if not ds_comm.is_initialized():
            raise RuntimeError("ZeroOptimizer: the process group is not initialised; call ds_comm.init_distributed() first")
        self.model, self.group, self.checkpoint_names = model, group, renames
        self.offload = policy.offload  # the optimizer steps on the CPU (ds_ops' Adam)
        policy.check_param_groups(group_options)
        self.gradient_clipping, self.model_parallel_group = float(gradient_clipping), model_parallel_group
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.world_size, self.rank = ds_comm.get_world_size(group), ds_comm.get_rank(group)
        self.tensor_parallel_rank, self.gradient_averaging_size = check_model_parallel(
            tensor_parallel_rank, gradient_averaging_size, model_parallel_group, self.world_size)
        self.scaler = LossScaler(fp16_config) if policy.loss_scaling else None
        self._counters = LoopCounters()  # micro-steps, skipped steps, the boundary set by hand, closed
        holders, replica_groups = adopt_model(model, params, policy, process_groups, group_of, group, self.world_size,
                                              self.device)  # the same model on every rank (`_replicas`)
        self._buffers = buffers = ZeroBuffers(
            model, params, policy, config=self.config, group=group, rank=self.rank, world_size=self.world_size,
            device=self.device, holders=holders, replica_groups=replica_groups, group_of=group_of,
            group_count=len(group_options) if group_options is not None else 1, managed={id(p) for p in params},
            aio=aio)
        self.layout = buffers.layout
        self._hooks: list[Any] = [*buffers.hooks]  # removed by close()
        self._slots = GradientSlots(model, params, self.layout, policy, buffers.grads)
        self._reducer = GradientReducer(
            owner=self, model=model, layout=self.layout, policy=policy, params=params, grads=buffers.grads,
            shard_grads=buffers.shard_grads, slots=self._slots, groups=buffers.bucket_groups,
            averaging_size=self.gradient_averaging_size, accumulation_steps=gradient_accumulation_steps,
            device=self.device, ignore_unused=self.config.ignore_unused_parameters,
            is_boundary=lambda: self.is_gradient_accumulation_boundary, trained_stage3=buffers.stage3,
            frozen_stage3=buffers.frozen_stage3, host=buffers.host)
        self.optimizer = _build_optimizer(optimizer, optimizer_kwargs, buffers, group_options, group=group,
                                          averaging_size=self.gradient_averaging_size, world_size=self.world_size)
        self._compressed = isinstance(self.optimizer, CompressedOptimizer)  # 1-bit: see _build_optimizer
        self._next_reduction()
        buffers.bind_optimizer(self.optimizer)
        self._zenflow = None  # `_zenflow`: its gradient hooks run before ZeRO's (which free the gradients)
        if self.config.zenflow is not None:
            if buffers.recipe is None:
                raise NotImplementedError(f"zero_optimization.zenflow steps Adam or AdamW; {type(self.optimizer).__name__} "
                                          f"is not implemented with it in ds-zero {version()}")
            self._zenflow = ZenFlow(self.config.zenflow, params, group_of, group, self.world_size, self.optimizer)
            self._hooks += self._zenflow.hooks
        self._master_step: MasterStep | None = master_step(
            recipe=buffers.recipe, nvme=buffers.nvme, host=buffers.host, tensors=buffers.step_params,
            grads=buffers.step_grads, host_grads=buffers.host_grads, host_copies=buffers.host_copies,
            copies=buffers.copies, master_grads=buffers.master_grads, zenflow=self._zenflow)
        link_parameters(self)  # each parameter finds its optimizer (ds_zero.safe_get_full_fp32_param & co)
        self._mover = StateMover(  # offload_states / reload_states
            roots=lambda state: state_roots(buffers, self.optimizer, self._reduction_buffers, state),
            views=lambda: state_views(buffers, self.optimizer), movable=movable_states(policy),
            param_device=self.config.offload_param.device if self.config.offload_param is not None else None,
            finish_in_flight=self._reducer.finish_in_flight)
        self._global_grad_norm: float | None = None
        if self.reduce_in_backward:
            self._hooks += [p.register_post_accumulate_grad_hook(self._reducer.on_gradient) for p in params]

    @property
    def internals(self) -> ZeroInternals:
        """What this optimizer keeps to itself, for ds-zero's checkpoint and state access (`ZeroInternals`)."""
        return OptimizerInternals(buffers=self._buffers, reducer=self._reducer, counters=self._counters,
                                  next_reduction=self._next_reduction)

    @property
    def stage(self) -> int:
        """The ZeRO stage (``zero_optimization.stage``); what it means is `policy` (a `ZeroPolicy`)."""
        return self.policy.stage

    # ------------------------------------------------------------------------------------- loop API
    @property
    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step ends an accumulation (its ``step()`` updates the model):
        counted from the micro-steps, unless `set_gradient_accumulation_boundary` says otherwise."""
        return self._counters.is_boundary(self.gradient_accumulation_steps, self._zenflow)

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Decide the boundary by hand (DeepSpeed's engine method): False accumulates the next backwards
        without reducing (stages 0-1) and makes ``step()`` count a micro-step only; True makes the next
        backward reduce and ``step()`` update. None goes back to counting ``gradient_accumulation_steps``."""
        self._counters.override_boundary(is_boundary)

    @property
    def loss_scale(self) -> float:
        """The factor ``backward`` multiplies the loss by (fp16 loss scaling; 1.0 otherwise)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """``loss.backward()``, times the fp16 loss scale and divided by ``gradient_accumulation_steps``
        (``scale_wrt_gas``); gradients are reduced bucket by bucket as backward produces them."""
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError(f"ZeroOptimizer.backward: loss must be a one-element tensor, got "
                             f"{type(loss).__name__}{tuple(loss.shape) if torch.is_tensor(loss) else ''}")
        if scale_wrt_gas and self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            loss = loss.float() * self.scaler.scale
        if self._zenflow is not None:
            self._zenflow.before_backward(self._counters.micro_step, lambda: master_from_model(
                self._buffers.host, self._buffers.step_params, self._buffers.host_copies))
        with GradientSlots.running(self):  # another optimizer's hooks firing in it know it is not theirs
            loss.backward(retain_graph=retain_graph)
        if self._zenflow is not None:
            self._zenflow.after_backward()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (a learning-rate schedule sets their ``lr``)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state (per stepped tensor: Adam's moments...), as DeepSpeed's wrappers give it."""
        return self.optimizer.state

    def step(self) -> bool:
        """At an accumulation boundary: wait for the reductions, check for overflow (fp16), clip,
        step, gather; returns True, or False when an overflow skipped the step (on every rank).
        Between boundaries: count the micro-step and return False."""
        self._counters.check_open("step")
        boundary = self.is_gradient_accumulation_boundary
        if self._zenflow is not None:
            self._zenflow.refresh_options(self.optimizer)
        self._counters.count(boundary)
        if not boundary:
            return False
        waited = time.perf_counter()
        self._reducer.wait_for_step()
        self._slots.check_at_step()  # what the step would not honour is refused by name (`_grad_slots`)
        self._reducer.accumulated = False  # the next backward starts the next accumulation
        if self._buffers.host is not None:  # ZeRO-Offload: every gradient shard on the host
            self._buffers.host.finish_downloads()
        self._reducer.wait_s += time.perf_counter() - waited
        self._buffers.point_step_grads()
        scale = self.loss_scale
        b = self._buffers
        norm = grad_norm(  # the same value on every rank
            b.params, sharded=self.policy.shard_optimizer, layout=self.layout, rank=self.rank, pieces=b.pieces,
            shard_grads=b.shard_grads, shard_starts=b.shard_starts, replicated=bool(b.replica_groups),
            group=self.group, model_parallel_group=self.model_parallel_group,
            tensor_parallel_rank=self.tensor_parallel_rank, dtype=self.dtype, device=self.device)
        if self.scaler is not None:
            if not math.isfinite(float(norm)):
                before = self.scaler.scale
                self.scaler.update(True)
                self._counters.skipped_steps += 1
                self._global_grad_norm = None
                logger.warning("fp16: gradient overflow, step skipped (loss scale %g -> %g)", before, self.scaler.scale)
                return False
            self.scaler.update(False)
        elif self.policy.check_overflow and not math.isfinite(float(norm)):
            self._counters.skipped_steps += 1
            self._global_grad_norm = None
            logger.warning("bf16: a gradient is inf or NaN, step skipped (bf16.check_grad_overflow)")
            return False
        self._global_grad_norm = float(norm) / scale
        self._master_step.step(self.optimizer, norm, self._global_grad_norm, scale, self.gradient_clipping)
        self._next_reduction()  # (a 1-bit optimizer's step decides whether the next gradients are averaged)
        b.refresh_parameters()
        if self._zenflow is not None:
            self._zenflow.after_step()
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the accumulated gradients (between boundaries this would drop micro-steps: it is a
        no-op there, as the accumulation needs them). ``set_to_none`` is accepted as torch's optimizers take
        it: at stages 0-1 each ``.grad`` stays its (zeroed) view of ZeRO's buffer, at stages 2-3 it is None."""
        if not self._counters.last_step_was_boundary:
            return
        self._buffers.zero_grads()
        if self._buffers.grads is not None:
            self._slots.point_at_views()  # a cleared or replaced .grad: its (zeroed) view again

    def close(self) -> None:
        """Detach from the model and free what ds-zero holds for training: the gradient hooks (and
        fp16.auto_cast's), gradients, reduction buffers, optimizer states and the master copy. The
        model keeps its current parameters and trains no further through this optimizer."""
        if self._counters.closed:
            return
        self._reducer.close()
        if self._zenflow is not None:  # its CPU step in flight
            self._zenflow.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._buffers.close(self.optimizer)
        self._master_step = None
        self._counters.closed = True

    @property
    def skipped_steps(self) -> int:
        """Boundary steps skipped because a gradient overflowed (fp16, ``bf16.check_grad_overflow``); a
        checkpoint saves and restores it."""
        return self._counters.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._counters.skipped_steps = int(value)

    def get_global_grad_norm(self) -> float | None:
        """The L2 norm of the whole (reduced, unscaled, unclipped) gradient at the last step; None
        before one and after a skipped (overflowed) step."""
        return self._global_grad_norm

    # ------------------------------------------------------------------------------------ reduction
    def wait_reductions(self) -> None:
        """Complete the gradient reductions backward has issued (they run in its hooks; `step` waits for
        them anyway): DeepSpeed's ``engine.allreduce_gradients()`` after backward."""
        self._reducer.finish_in_flight()

    def reduce_gradients(self) -> None:
        """Start the reduction of every bucket from the gradients in ``.grad`` (with
        ``reduce_in_backward=False``: the caller's backward passes are done); `step` waits for it. A
        parameter without a gradient counts as zeros."""
        if self.reduce_in_backward:
            raise RuntimeError("ZeroOptimizer.reduce_gradients: this optimizer reduces in its backward hooks; build it "
                               "with reduce_in_backward=False to reduce by hand")
        self._reducer.reduce_all()

    @property
    def reduction_wait_s(self) -> float:
        """Seconds spent waiting for gradient reductions (the engine's "allreduce" timer)."""
        return self._reducer.wait_s

    def _reduction_buffers(self) -> list[torch.Tensor]:
        return [*self._reducer.bucket_buffers, *self._reducer.received]

    def _next_reduction(self) -> None:  # whether the next accumulation is averaged (a 1-bit optimizer decides)
        if self._compressed:
            self._reducer.average_now = self.optimizer.wants_averaged_gradients()

    # ---------------------------------------------------------------------------------------- state
    def full_state_dict(self, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()`` with every parameter whole, as copies in its training dtype
        (stage 3 gathers one unit at a time: every rank calls it). With ``rank0_only`` the other ranks
        get ``{}`` and hold no copy (``stage3_gather_16bit_weights_on_model_save``)."""
        return full_state_dict(self.model, [self._buffers.stage3, self._buffers.frozen_stage3],
                               keep=not rank0_only or self.rank == 0)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the model's states, by kind: ``params`` (the flat parameters,
        16-bit with fp16/bf16; at stage 3 this rank's partition plus the units gathered now),
        ``grads`` (full at stages 0-1, this rank's partition at stages 2-3, plus
        float32 copies for a non-Adam optimizer of a 16-bit model), ``master`` (the float32 copy of
        what this rank steps; none in float32 training, where the parameters are the master, nor with
        ``bf16.bf16_master_weights_and_grads``, where the bf16 parameters are),
        ``optimizer`` (the optimizer's state tensors), and ``buffers`` (reusable reduction buffers; at stage 3
        also released gather buffers kept for reuse)."""
        return memory_bytes(self._buffers, self.optimizer, self._reduction_buffers())

    def _identity(self) -> dict[str, Any]:
        return identity(stage=self.stage, world_size=self.world_size, rank=self.rank, precision=self.precision,
                        layout=self.layout)

    def state_dict(self) -> dict[str, Any]:
        """This rank's part: the optimizer's state over its shards, the float32 master copy (16-bit
        models), the loss scaler (fp16), what it was laid out for, and at stage 3 this rank's shards of
        the parameters (the model's own ``state_dict()`` holds empty tensors there)."""
        return rank_state(self._identity(), self._buffers, self.optimizer, self.scaler,
                          micro_step=self._counters.micro_step, skipped_steps=self._counters.skipped_steps)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a `state_dict` saved by the same rank of the same layout (loading on another world
        size or stage is the checkpoint issue's reshaping). Every rank calls it: with a master copy
        the parameters are set from it and gathered (at stage 3, from the shards in the state)."""
        load_rank_state(state, self._identity(), self._buffers, self.optimizer, self.scaler,
                        optimizer_loaded=self._next_reduction, set_counters=self._counters.restore)
        if needs_refresh(self._buffers):
            self._buffers.refresh_parameters()

    # ------------------------------------------------------------------------------- offload states
    def offload_states(self, include: Iterable[OffloadStateTypeEnum] | None = None,
                       device: OffloadDeviceEnum = OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move the states in ``include`` (default: all; see `OffloadStateTypeEnum`) to ``device`` (the
        host: ``OffloadDeviceEnum.cpu``; ``none`` does nothing, ``nvme`` is refused, as in DeepSpeed), into
        pinned memory with ``pin_memory``. Call it between (micro-)steps; `reload_states`
        brings them back. A state already offloaded, or already on the host, is not moved again. Gradient
        reductions still in flight (stages 2-3 between micro-steps) are completed first (`_offload_states`)."""
        self._mover.offload(include, device, pin_memory=pin_memory, non_blocking=non_blocking, closed=self._counters.closed)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Move every state `offload_states` moved back to the device it came from."""
        self._mover.reload(non_blocking=non_blocking, closed=self._counters.closed)

    @property
    def offloaded_states(self) -> set[OffloadStateTypeEnum]:
        """The states `offload_states` moved and `reload_states` has not brought back."""
        return set(self._mover.offloaded)

    # --------------------------------------------------------------------------------- engine calls
    @property
    def fp16_groups(self) -> list[list]:
        """The model's parameters this optimizer trains, one list per parameter group in the groups'
        order (DeepSpeed's ZeRO optimizers' ``fp16_groups``/``bit16_groups``: the parameters whatever their
        dtype; at stage 3 they are the partitioned parameters, made whole by `GatheredParameters`).
        Read-only: a new list each time."""
        return grouped(self._buffers.params, self._buffers.group_of, self._buffers.group_count)

    @property
    def bit16_groups(self) -> list[list]:
        """`fp16_groups` under DeepSpeed's other name (ZeRO-1/2)."""
        return self.fp16_groups

    @property
    def nccl_start_alignment_factor(self) -> int:
        """The number of elements each rank's partition of a bucket is a multiple of, so that every
        partition starts at a multiple of it (DeepSpeed's ZeRO-1/2: 2, four bytes of fp16; ds-zero: 1,
        or a 4 KiB page of elements for stage 3's parameters on NVMe)."""
        return self.layout.align

    def set_gradient_accumulation_steps(self, steps: int) -> None:
        """Accumulate ``steps`` micro-steps per optimizer step from the next accumulation on. Only at an
        accumulation's start (between a boundary's step and the next backward): a RuntimeError otherwise."""
        self.gradient_accumulation_steps = check_accumulation_steps(
            steps, reduce_in_backward=self.reduce_in_backward, accumulating=not self._counters.last_step_was_boundary or
            self._reducer.accumulated or self._reducer.fired)
        self._counters.micro_step = 0  # the next micro-step starts an accumulation of the new length

    def refresh_fp32_params(self) -> None:
        """Take the float32 master copy again from the model's parameters (DeepSpeed's name), after
        something wrote them directly (``model.load_state_dict``): otherwise the next step would put the
        master copy's values back. Nothing to do in float32 (the parameters are the master copy) or at
        stage 3 (`GatheredParameters` with a ``modifier_rank`` updates it)."""
        refresh_master(self._buffers)

    def empty_partition_cache(self) -> None:
        """Stage 3: release every gathered parameter not persistent or in use, and the pooled gather
        buffers (DeepSpeed's name); they are gathered again when used. Nothing at stages 0-2."""
        empty_partition_cache(self._buffers.stage3, self._buffers.frozen_stage3)

    # read-only views of the parts, for tests written against the mixins' attributes
    _params = property(lambda self: self._buffers.params)
    _flat = property(lambda self: self._buffers.flat)
    _master = property(lambda self: self._buffers.master)
    _grads = property(lambda self: self._buffers.grads)
    _partition = property(lambda self: self._buffers.partition)
    _shard_grads = property(lambda self: self._buffers.shard_grads)
    _shard_starts = property(lambda self: self._buffers.shard_starts)
    _step_params = property(lambda self: self._buffers.step_params)
    _host = property(lambda self: self._buffers.host)
    _nvme = property(lambda self: self._buffers.nvme)
    _stage3 = property(lambda self: self._buffers.stage3)
    _frozen = property(lambda self: self._buffers.frozen)
    _bucket_buffers = property(lambda self: self._reducer.bucket_buffers)
    _received = property(lambda self: self._reducer.received)


def _build_optimizer(optimizer: Any, optimizer_kwargs: dict[str, Any] | None, buffers: ZeroBuffers,
                     group_options: list[dict[str, Any]] | None, *, group: Any, averaging_size: int,
                     world_size: int) -> Any:
    """``optimizer`` over the tensors ``buffers`` steps (one per run); with ``group_options`` every group kept
    (empty where this rank steps none of it): the same groups on every rank. What the policy cannot step with
    it is refused."""
    tensors, policy = buffers.step_params, buffers.policy
    if group_options is None:
        built = optimizer(tensors, **(optimizer_kwargs or {}))
    else:
        built = optimizer([{**options, "params": [t for t, run in zip(tensors, buffers.runs, strict=True)
                                                  if run[3] == g]} for g, options in enumerate(group_options)],
                          **(optimizer_kwargs or {}))
    check_optimizer(built, policy.offload)
    if policy.bf16_master:
        check_bf16_master_optimizer(built, policy.offload, policy.bf16_optimizer_states)
    # a 1-bit optimizer (ds_zero.onebit) averages what it needs itself: ZeRO reduces only on the steps it
    # asks for (DeepSpeed's enable_backward_allreduce) and leaves the gradients local otherwise
    if isinstance(built, CompressedOptimizer):
        policy.check_compressed(type(built).__name__, averaging_size=averaging_size, world_size=world_size,
                                replicated=bool(buffers.replica_groups))
        built.bind(group, caller_reduces=True)
        mask_padding(built, tensors, buffers.owned, buffers.layout)
    return built

