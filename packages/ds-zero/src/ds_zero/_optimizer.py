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
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import ds_comm

from ._collectives import gather_buckets, grad_norm
from ._compressed import CompressedOptimizer
from ._engine_calls import EngineCalls
from ._filling import check_optimizer, fill_master, shard_modified
from ._frozen import FrozenShards, partitioned_frozen
from ._grad_slots import GradientSlots
from ._groups import mask_padding, option_groups, step_runs
from ._internals import ZeroInternals
from ._layout import FlatLayout
from ._master import MasterStep, master_step, step_grad_views
from ._model import (
    broadcast_from_first_rank,
    check_same_model,
    checked_renames,
    full_shape,
    is_init_partitioned,
    model_device,
    trainable,
    unpartition,
    version,
)
from ._nvme import NvmeOptimizer
from ._offload import HostOffload, host_places
from ._offload_states import OffloadStates
from ._policy import ZeroPolicy, resolve
from ._precision import (
    adam_recipe,
    cast_floating_inputs,
    check_bf16_master_optimizer,
)
from ._records import build_records
from ._reduction import GradientReducer
from ._replicas import (
    check_and_broadcast,
    check_model_parallel,
    refuse_replicas,
    replica_holders,
    split_process_groups,
)
from ._scaler import LossScaler
from ._sharded import ShardedParams
from ._state import State
from ._state_access import link_parameters
from ._zenflow import ZenFlow, master_from_model

logger = logging.getLogger(__name__)

# Buckets hold at most this many elements, whatever reduce_bucket_size allows (DeepSpeed's default,
# 5e8, makes one bucket of a model below 500M parameters: its reduction cannot start before backward
# ends). 4M float32 elements (16 MiB, near DDP's 25 MiB buckets) overlap reduction with backward and
# keep stage 2's bucket buffers small; measured on the engine workload, see the README.
OVERLAP_BUCKET_ELEMENTS = 1 << 22

class ZeroOptimizer(State, OffloadStates, EngineCalls):
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
        self._check_overflow = policy.check_overflow  # bf16: inf/NaN gradients skip the step (check_grad_overflow)
        self._bf16_master = policy.bf16_master  # no float32 copy: the optimizer steps the 16-bit partition
        self._bf16_optimizer_states = policy.bf16_optimizer_states
        self.reduce_in_backward = policy.reduce_in_backward
        params = trainable(model)
        group_of, group_options = option_groups(param_groups, model, params)
        if None in group_of:  # in no group: not optimized, held as a frozen parameter is
            params = [p for p, g in zip(params, group_of, strict=True) if g is not None]
            group_of = [g for g in group_of if g is not None]
        group_options, process_groups = split_process_groups(group_options)  # `_replicas`
        policy.check_params(model, params)
        self.device = model_device(model, params)  # every buffer below is made there
        if not ds_comm.is_initialized():
            raise RuntimeError("ZeroOptimizer: the process group is not initialised; call ds_comm.init_distributed() first")
        self.model, self.group, self._params = model, group, params
        self.checkpoint_names = renames
        offload_device = policy.offload_device
        self.offload = policy.offload  # the optimizer steps on the CPU (ds_ops' Adam)
        policy.check_param_groups(group_options)
        self._nvme = None  # NvmeOptimizer: Adam's states (and the master copy) on NVMe
        self.gradient_clipping, self.model_parallel_group = float(gradient_clipping), model_parallel_group
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.world_size, self.rank = ds_comm.get_world_size(group), ds_comm.get_rank(group)
        self.tensor_parallel_rank, self.gradient_averaging_size = check_model_parallel(
            tensor_parallel_rank, gradient_averaging_size, model_parallel_group, self.world_size)
        self.scaler = LossScaler(fp16_config) if policy.loss_scaling else None
        self.skipped_steps = 0
        # parameters replicated over a subgroup of ``group`` (a param group's process_group): `_replicas`
        holders, self._replica_groups = replica_holders(process_groups, group_of, group)
        if self._replica_groups:
            policy.check_replicas(refuse_replicas)
            check_and_broadcast(model, params, holders, self._replica_groups, group, self.world_size, self.device)
        else:
            check_same_model(model, params, group, self.world_size, self.device)
            broadcast_from_first_rank(model, group)
        managed = {id(p) for p in params}
        for p in model.parameters():  # built under Init: whole again, but stage 3's trainable and frozen ones
            if is_init_partitioned(p) and (not policy.shard_params or (id(p) not in managed and p.requires_grad)):
                unpartition(p)

        bucket_size = min(self.config.reduce_bucket_size, OVERLAP_BUCKET_ELEMENTS)
        params_on_nvme = policy.params_on_nvme
        self._sharded: ShardedParams | None = None
        if policy.shard_params:  # one bucket per fetch unit (a module's parameters), the flat buffer a partition
            # parameters on NVMe: every shard starts on a 4 KiB boundary of the file (O_DIRECT reads), and the
            # partition is never touched, so never in RAM (its storage is dropped below)
            self._sharded = ShardedParams(model, params, config=self.config, group=group, dtype=self.dtype,
                                          device=self.device, bucket_size=bucket_size,
                                          align=4096 // self.dtype.itemsize if params_on_nvme else 1,
                                          stepped_on_host=self.offload, on_disk=params_on_nvme)
            self.layout = self._sharded.layout
        else:
            self.layout = FlatLayout([full_shape(p) for p in params], world_size=self.world_size,
                                     bucket_size=bucket_size, holders=holders)
        layout = self.layout
        self._bucket_groups = [self._replica_groups.get(b.ranks, group) for b in layout.buckets]  # reduced over
        self._shard_starts = layout.partition_offsets()
        if policy.shard_params:  # the flat buffer is this rank's partition: ranges below are in it
            self._owned = [(at, b.shard) for b, at in zip(layout.buckets, self._shard_starts, strict=True)]
        else:
            self._owned = [layout.shard_range(b, self.rank) if policy.shard_optimizer else (b.offset, b.padded) for b in layout.buckets]
        self._flat = self._sharded.partition if self._sharded is not None else \
            torch.zeros(layout.numel, dtype=self.dtype, device=self.device)
        self._master = None  # a float32 master copy of what this rank steps, when the model is 16-bit
        self._hooks: list[Any] = []  # removed by close()
        # NVMe: the master copy is on disk; bf16 master weights: the bf16 partition is; ZeRO-Offload: on the host,
        # float32 for a float32 model too (bf16 master weights: the host mirrors the partition), see _offload
        self._host: HostOffload | None = None
        master_numel = layout.shard_numel if policy.shard_optimizer else layout.numel
        if self.offload:
            self._host = HostOffload(self.device, master_numel, host_places(layout, policy.shard_optimizer, self._shard_starts),
                                     dtype=self.dtype, master_dtype=None if offload_device == "nvme" else
                                     self.dtype if self._bf16_master else torch.float32, mirror=self._bf16_master)
            self._master = None if self._bf16_master else self._host.master
        elif self.dtype != torch.float32 and not self._bf16_master:
            self._master = torch.zeros(master_numel, dtype=torch.float32, device=self.device)
        if offload_device == "nvme":
            nvme = self.config.offload_optimizer
            self._nvme = NvmeOptimizer(layout.shard_numel, sub_group_size=self.config.sub_group_size,
                                       master=self.dtype != torch.float32, nvme_path=nvme.nvme_path, aio=aio,
                                       rank=self.rank, pipeline_read=nvme.pipeline_read,
                                       pipeline_write=nvme.pipeline_write,
                                       param_dtype=self.dtype if params_on_nvme else None)
        if self._sharded is not None:  # this rank's shards (and master copy), the parameters released
            self._sharded.fill(master=self._master, clear_grads=True, on_disk=self._nvme.write_params
                               if self._nvme is not None and self._nvme.param_dtype is not None else None)
        else:
            if self._master is not None:
                fill_master(self._master, params, layout, self.rank, sharded=policy.shard_optimizer, dtype=self.dtype)
            for p, slot in zip(params, layout.slots, strict=True):
                view = self._flat[slot.offset:slot.offset + slot.numel].view(p.shape)
                view.copy_(p.detach())
                p.data = view
                p.grad = None
        if policy.cast_model:  # the rest of the model (frozen parameters, buffers) too
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.is_floating_point() and tensor.dtype != self.dtype and not hasattr(tensor, "ds_init_store"):
                    tensor.data = tensor.data.to(self.dtype)
            if policy.auto_cast:
                self._hooks.append(model.register_forward_pre_hook(cast_floating_inputs(self.dtype), with_kwargs=True))
        self._stage3 = None if self._sharded is None else self._sharded.attach(  # (the master as it is then)
            on_modified=lambda b, v: shard_modified(self._master, self._nvme, self._shard_starts, b, v),
            shards=self._nvme if params_on_nvme else None)
        frozen = partitioned_frozen(model, policy.shard_params, self.dtype, managed)  # stage 3: partitioned too (_frozen)
        self._frozen = FrozenShards(model, frozen, self.config, group, self.dtype, self._stage3) if frozen else None
        # the optimizer steps one tensor per run: a bucket's stepped range, split where the option group
        # changes (one run per bucket without param_groups); (bucket, offset in the range, length, group)
        self._runs = step_runs(layout, policy.shard_optimizer, self.rank, group_of)
        self._group_of, self._group_count = group_of, len(group_options) if group_options is not None else 1
        # where each parameter's pieces live (the master copy is laid out as the partition when it is one)
        self._records = build_records(layout, params, self.rank, sharded=policy.shard_optimizer,
                                      master_in_partition=policy.shard_optimizer and (
                                          self._master is not None or policy.shard_params),
                                      shard_starts=self._shard_starts, runs=self._runs, groups=self._bucket_groups)
        # where each bucket's stepped part lives in the master copy (the flat buffer itself in float32)
        if self._master is None or not policy.shard_optimizer:
            in_master = self._owned
        else:
            in_master = [(at, b.shard) for b, at in zip(layout.buckets, self._shard_starts, strict=True)]
        # stages 0-1: every .grad a view of one flat buffer, which backward accumulates into (`_grad_slots`)
        self._grads = torch.zeros(layout.numel, dtype=self.dtype, device=self.device) if policy.whole_grads else None
        self._slots = GradientSlots(model, params, layout, policy, self._grads)
        self._partition = None
        if not policy.shard_optimizer:
            self._shard_grads = [self._grads[start:start + length] for start, length in self._owned]
        else:  # stage 1 too: each reduction averages the whole local accumulation into the partition anew
            self._partition = torch.zeros(layout.shard_numel, dtype=self.dtype, device=self.device)
            self._shard_grads = [self._partition[at:at + b.shard] for b, at in zip(layout.buckets, self._shard_starts,
                                                                                   strict=True)]
        if self._host is not None:  # where each bucket's reduced gradients land, where its parameters are stepped
            self._host.bind(list(self._shard_grads), [self._flat[at:at + n] for at, n in self._owned])
        # per bucket above (what its reduction writes), per run below (what the optimizer steps)
        self._step_grads = [self._shard_grads[b][at:at + n] for b, at, n, _ in self._runs]
        in_master = [(in_master[b][0] + at, n) for b, at, n, _ in self._runs]
        on_host = [(self._host.places[b][0] + at, n) for b, at, n, _ in self._runs] if self._host is not None else []
        self._owned = [(self._owned[b][0] + at, n) for b, at, n, _ in self._runs]
        self._reducer = GradientReducer(
            owner=self, model=model, layout=layout, policy=policy, params=params, grads=self._grads,
            shard_grads=self._shard_grads, slots=self._slots, groups=self._bucket_groups,
            averaging_size=self.gradient_averaging_size, accumulation_steps=gradient_accumulation_steps,
            device=self.device, ignore_unused=self.config.ignore_unused_parameters,
            is_boundary=lambda: self.is_gradient_accumulation_boundary, trained_stage3=self._stage3,
            frozen_stage3=self._frozen.stage3 if self._frozen is not None else None, host=self._host)
        self._pieces = layout.pieces(self.rank)  # for the gradient norm at stages 1-2
        master = self._flat if self._master is None else self._master
        stepped = in_master
        if self._host is not None and self._host.master is not None:  # ZeRO-Offload: the host's copy is stepped
            master, stepped = self._host.master, on_host
        self._step_params = [nn.Parameter(master[at:at + n], requires_grad=True) for at, n in stepped]
        if group_options is None:
            self.optimizer = optimizer(self._step_params, **(optimizer_kwargs or {}))
        else:  # every group kept (empty where this rank steps none of it): the same groups on every rank
            self.optimizer = optimizer([{**options, "params": [t for t, run in zip(self._step_params, self._runs,
                                                                                   strict=True) if run[3] == g]}
                                        for g, options in enumerate(group_options)], **(optimizer_kwargs or {}))
        check_optimizer(self.optimizer, self.offload)
        if self._bf16_master:
            check_bf16_master_optimizer(self.optimizer, self.offload, self._bf16_optimizer_states)
        # a 1-bit optimizer (ds_zero.onebit) averages what it needs itself: ZeRO reduces only on the steps it
        # asks for (DeepSpeed's enable_backward_allreduce) and leaves the gradients local otherwise
        self._compressed = isinstance(self.optimizer, CompressedOptimizer)
        if self._compressed:
            policy.check_compressed(type(self.optimizer).__name__, averaging_size=self.gradient_averaging_size,
                                    world_size=self.world_size, replicated=bool(self._replica_groups))
            self.optimizer.bind(group, caller_reduces=True)
            mask_padding(self.optimizer, self._step_params, self._owned, layout)
        self._next_reduction()
        if self._nvme is not None:  # the parameters on NVMe are in their file already
            self._nvme.initialize(None if params_on_nvme else self._flat)
            if params_on_nvme:
                self._flat.untyped_storage().resize_(0)
        # the fused path: 16-bit models and CPU offload step Adam-family optimizers with ds_ops.adam_step
        self._recipe = adam_recipe(self.optimizer) if (self._master is not None or self.offload) else None
        self._copies = None if self._master is None else [self._flat[s:s + n] for s, n in self._owned]
        self._master_grads = None  # float32 gradients for a non-Adam optimizer of a 16-bit model
        if self._master is not None and self._recipe is None:
            self._master_grads = torch.zeros_like(self._master, device=self._master.device)
        # ZeRO-Offload: the CPU Adam reads the gradients copied to the host, writes the new parameters there
        self._host_grads, self._host_copies = self._host.views(on_host) if self._host is not None else ([], None)
        self._grad_views = step_grad_views(self._step_params, self._host_grads if self._host is not None else
                                           self._step_grads, in_master, self._master_grads)
        self._point_step_grads()
        self._zenflow = None  # `_zenflow`: its gradient hooks run before ZeRO's (which free the gradients)
        if self.config.zenflow is not None:
            if self._recipe is None:
                raise NotImplementedError(f"zero_optimization.zenflow steps Adam or AdamW; {type(self.optimizer).__name__} "
                                          f"is not implemented with it in ds-zero {version()}")
            self._zenflow = ZenFlow(self.config.zenflow, params, group_of, group, self.world_size, self.optimizer)
            self._hooks += self._zenflow.hooks
        self._master_step: MasterStep | None = master_step(
            recipe=self._recipe, nvme=self._nvme, host=self._host, tensors=self._step_params, grads=self._step_grads,
            host_grads=self._host_grads, host_copies=self._host_copies, copies=self._copies,
            master_grads=self._master_grads, zenflow=self._zenflow)

        link_parameters(self)  # each parameter finds its optimizer (ds_zero.safe_get_full_fp32_param & co)
        self._micro_step = 0
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary's, None: counted
        self._last_step_was_boundary = True  # zero_grad zeroes only after a boundary's step
        self._offloaded: dict[str, dict[int, torch.device]] = {}  # offload_states: state -> root -> its device
        self._global_grad_norm: float | None = None
        self._closed = False
        if self.reduce_in_backward:
            self._hooks += [p.register_post_accumulate_grad_hook(self._reducer.on_gradient) for p in params]

    def _point_step_grads(self) -> None:
        """Each tensor the optimizer steps has its gradient slice as ``.grad`` (again: the client optimizer's
        ``zero_grad()`` sets them to None, as DeepSpeed's ZeRO points them again at every step)."""
        for tensor, grad in self._grad_views:
            tensor.grad = grad

    @property
    def internals(self) -> ZeroInternals:
        """What this optimizer keeps to itself, for ds-zero's checkpoint and state access (`ZeroInternals`)."""
        return _Internals(self)

    @property
    def stage(self) -> int:
        """The ZeRO stage (``zero_optimization.stage``); what it means is `policy` (a `ZeroPolicy`)."""
        return self.policy.stage

    # ------------------------------------------------------------------------------------- loop API
    @property
    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step ends an accumulation (its ``step()`` updates the model):
        counted from the micro-steps, unless `set_gradient_accumulation_boundary` says otherwise."""
        if self._boundary_override is not None:
            return self._boundary_override
        if self._zenflow is not None:
            return self._zenflow.is_update_boundary(self._micro_step)
        return (self._micro_step + 1) % self.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Decide the boundary by hand (DeepSpeed's engine method): False accumulates the next backwards
        without reducing (stages 0-1) and makes ``step()`` count a micro-step only; True makes the next
        backward reduce and ``step()`` update. None goes back to counting ``gradient_accumulation_steps``."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise ValueError(f"set_gradient_accumulation_boundary: is_boundary must be True, False or None, got "
                             f"{is_boundary!r}")
        self._boundary_override = is_boundary

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
            self._zenflow.before_backward(self._micro_step, lambda: master_from_model(self._host, self._step_params,
                                                                                      self._host_copies))
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
        if self._closed:
            raise RuntimeError("ZeroOptimizer.step: this optimizer was closed")
        boundary = self.is_gradient_accumulation_boundary
        if self._zenflow is not None:
            self._zenflow.refresh_options(self.optimizer)
        self._micro_step += 1
        self._last_step_was_boundary = boundary
        if not boundary:
            return False
        waited = time.perf_counter()
        self._reducer.wait_for_step()
        self._slots.check_at_step()  # what the step would not honour is refused by name (`_grad_slots`)
        self._reducer.accumulated = False  # the next backward starts the next accumulation
        if self._host is not None:  # ZeRO-Offload: every gradient shard on the host
            self._host.finish_downloads()
        self._reducer.wait_s += time.perf_counter() - waited
        self._point_step_grads()
        scale = self.loss_scale
        norm = grad_norm(  # the same value on every rank
            self._params, sharded=self.policy.shard_optimizer, layout=self.layout, rank=self.rank, pieces=self._pieces,
            shard_grads=self._shard_grads, shard_starts=self._shard_starts, replicated=bool(self._replica_groups),
            group=self.group, model_parallel_group=self.model_parallel_group,
            tensor_parallel_rank=self.tensor_parallel_rank, dtype=self.dtype, device=self.device)
        if self.scaler is not None:
            if not math.isfinite(float(norm)):
                before = self.scaler.scale
                self.scaler.update(True)
                self.skipped_steps += 1
                self._global_grad_norm = None
                logger.warning("fp16: gradient overflow, step skipped (loss scale %g -> %g)", before, self.scaler.scale)
                return False
            self.scaler.update(False)
        elif self._check_overflow and not math.isfinite(float(norm)):
            self.skipped_steps += 1
            self._global_grad_norm = None
            logger.warning("bf16: a gradient is inf or NaN, step skipped (bf16.check_grad_overflow)")
            return False
        self._global_grad_norm = float(norm) / scale
        self._master_step.step(self.optimizer, norm, self._global_grad_norm, scale, self.gradient_clipping)
        self._next_reduction()  # (a 1-bit optimizer's step decides whether the next gradients are averaged)
        self._refresh_parameters()
        if self._zenflow is not None:
            self._zenflow.after_step()
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the accumulated gradients (between boundaries this would drop micro-steps: it is a
        no-op there, as the accumulation needs them). ``set_to_none`` is accepted as torch's optimizers take
        it: at stages 0-1 each ``.grad`` stays its (zeroed) view of ZeRO's buffer, at stages 2-3 it is None."""
        if not self._last_step_was_boundary:
            return
        if self._grads is not None:
            self._grads.zero_()
            self._slots.point_at_views()  # a cleared or replaced .grad: its (zeroed) view again
        if self._partition is not None:
            self._partition.zero_()
        if self.policy.shard_grads:
            for p in self._params:
                p.grad = None

    def close(self) -> None:
        """Detach from the model and free what ds-zero holds for training: the gradient hooks (and
        fp16.auto_cast's), gradients, reduction buffers, optimizer states and the master copy. The
        model keeps its current parameters and trains no further through this optimizer."""
        if self._closed:
            return
        self._reducer.close()
        if self._zenflow is not None:  # its CPU step in flight
            self._zenflow.close()
        if self._host is not None:
            self._host.forget_downloads()
        for stage3 in (self._stage3, self._frozen.stage3 if self._frozen is not None else None):
            if stage3 is not None:  # every parameter whole again (a collective: every rank closes)
                stage3.gather_all()
        if self._nvme is not None:
            self._nvme.close()
            self._nvme = None
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for p in self._params:
            p.grad = None
        for tensor in self._step_params:
            tensor.grad = None
        self.optimizer.state.clear()
        self._grads = self._partition = self._master = self._master_grads = None
        self._step_grads, self._copies = [], None
        self._shard_grads, self._host_grads, self._host_copies, self._host = [], [], None, None
        self._master_step, self._grad_views = None, []
        self._closed = True

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

    _bucket_buffers = property(lambda self: self._reducer.bucket_buffers)  # (read by tests)
    _received = property(lambda self: self._reducer.received)

    def _refresh_parameters(self) -> None:
        """After the stepped part changed: every rank's shards into the parameters (stages 1-2), or
        into the units gathered now (stage 3: the others are gathered when used)."""
        if self._stage3 is not None:
            self._stage3.after_step()
        elif self.policy.shard_optimizer:
            gather_buckets(self._flat, self.layout.buckets, self._bucket_groups)

    def _next_reduction(self) -> None:  # whether the next accumulation is averaged (a 1-bit optimizer decides)
        if self._compressed:
            self._reducer.average_now = self.optimizer.wants_averaged_gradients()


class _Internals:
    """`ZeroInternals` over one `ZeroOptimizer` (a view: it reads the optimizer's current parts)."""

    __slots__ = ("_zero",)

    def __init__(self, zero: ZeroOptimizer):
        self._zero = zero

    records = property(lambda self: self._zero._records)
    step_tensors = property(lambda self: self._zero._step_params)
    flat = property(lambda self: self._zero._flat)
    nvme = property(lambda self: self._zero._nvme)
    host = property(lambda self: self._zero._host)
    frozen = property(lambda self: self._zero._frozen)
    recipe = property(lambda self: self._zero._recipe)
    replica_groups = property(lambda self: self._zero._replica_groups)
    closed = property(lambda self: self._zero._closed)
    accumulated = property(lambda self: self._zero._reducer.accumulated)
    boundary_reduced = property(lambda self: self._zero._reducer.boundary_reduced)
    grad_buffer = property(lambda self: self._zero._grads)
    grad_partition = property(lambda self: self._zero._partition)

    @property
    def master(self) -> torch.Tensor:
        return self._zero._flat if self._zero._master is None else self._zero._master

    @property
    def has_master_copy(self) -> bool:
        return self._zero._master is not None

    @property
    def micro_step(self) -> int:
        return self._zero._micro_step

    @micro_step.setter
    def micro_step(self, value: int) -> None:
        self._zero._micro_step = int(value)

    def wait_reductions(self) -> None:
        self._zero.wait_reductions()

    def gradients_changed(self) -> None:
        if self._zero._host is not None:
            self._zero._host.forget_downloads()

    def master_loaded(self) -> None:
        zero = self._zero
        if zero._master is not None:
            for copy, tensor in zip(zero._copies, zero._step_params, strict=True):
                copy.copy_(tensor.detach())
        if zero._nvme is not None and zero._nvme.master:  # 16-bit parameters from the master copy on disk
            zero._nvme.params_from_master(zero._flat if zero._nvme.param_dtype is None else None)
        zero._refresh_parameters()

    def next_reduction(self) -> None:
        self._zero._next_reduction()
