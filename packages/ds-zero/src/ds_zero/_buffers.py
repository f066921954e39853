"""`ZeroBuffers`: the tensors a `ZeroOptimizer` trains through, laid out once from its `ZeroPolicy`.

It owns the flat parameters (views of which the model's parameters become; at stage 3 this rank's
partition, `ShardedParams`), the master copy where there is one (float32 on the device, the host's
under ZeRO-Offload, on NVMe under ZeRO-Infinity: `HostOffload`, `NvmeOptimizer`), the gradients (the flat
buffer of stages 0-1, this rank's partition at stages 1-3), and the tensors the optimizer steps: one
per run, a bucket's stepped range split where the parameter group changes (`step_runs`), with the
gradient each reads as ``.grad``. Built in two halves: the constructor lays out and fills everything the
optimizer is built over (``step_params``); `bind_optimizer` adds what depends on that optimizer (the fused
Adam recipe, the 16-bit copies it writes, the float32 gradients of a non-Adam optimizer).
Its inputs are explicit; the optimizer reads its attributes, and nothing here reads the optimizer's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._collectives import gather_buckets
from ._filling import fill_master, shard_modified
from ._frozen import FrozenShards, partitioned_frozen
from ._groups import step_runs
from ._layout import FlatLayout
from ._master import step_grad_views
from ._model import full_shape
from ._nvme import NvmeOptimizer
from ._offload import HostOffload, host_places
from ._policy import ZeroPolicy
from ._precision import adam_recipe, cast_floating_inputs
from ._records import build_records
from ._sharded import ShardedParams
from ._zeropp import UnitGathers

# Buckets hold at most this many elements, whatever reduce_bucket_size allows (DeepSpeed's default,
# 5e8, makes one bucket of a model below 500M parameters: its reduction cannot start before backward
# ends). 4M float32 elements (16 MiB, near DDP's 25 MiB buckets) overlap reduction with backward and
# keep stage 2's bucket buffers small; measured on the engine workload, see the README.
OVERLAP_BUCKET_ELEMENTS = 1 << 22


class ZeroBuffers:
    """The flat buffers of one `ZeroOptimizer` (see the module docstring). ``params``: the trained parameters;
    ``group_of``: each one's parameter group (of ``group_count``); ``holders``/``replica_groups``: the ranks
    each is replicated over and their subgroups (`_replicas`); ``managed``: ids of ``params`` (stage 3
    partitions the model's other parameters as frozen ones); ``aio``: the ``aio`` section for NVMe."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], policy: ZeroPolicy, *, config: Any, group: Any,
                 rank: int, world_size: int, device: torch.device, holders: list, replica_groups: dict,
                 group_of: list[int], group_count: int, managed: set[int], aio: Any):
        dtype = policy.dtype
        self.params, self.policy, self.rank, self.dtype = params, policy, rank, dtype
        self.group_of, self.group_count, self.replica_groups = group_of, group_count, replica_groups
        self.hooks: list[Any] = []  # fp16.auto_cast's forward pre-hook
        bucket_size = min(config.reduce_bucket_size, OVERLAP_BUCKET_ELEMENTS)
        on_disk = policy.params_on_nvme
        self.sharded: ShardedParams | None = None
        if policy.shard_params:  # one bucket per fetch unit (a module's parameters), the flat buffer a partition
            # parameters on NVMe: every shard starts on a 4 KiB boundary of the file (O_DIRECT reads), and the
            # partition is never touched, so never in RAM (its storage is dropped in bind_optimizer)
            self.sharded = ShardedParams(model, params, config=config, group=group, dtype=dtype, device=device,
                                         bucket_size=bucket_size, align=4096 // dtype.itemsize if on_disk else 1,
                                         stepped_on_host=policy.offload, on_disk=on_disk)
            self.layout = self.sharded.layout
        else:
            self.layout = FlatLayout([full_shape(p) for p in params], world_size=world_size,
                                     bucket_size=bucket_size, holders=holders)
        layout = self.layout
        self.bucket_groups = [replica_groups.get(b.ranks, group) for b in layout.buckets]  # reduced over
        self.shard_starts = layout.partition_offsets()
        if policy.shard_params:  # the flat buffer is this rank's partition: ranges below are in it
            owned = [(at, b.shard) for b, at in zip(layout.buckets, self.shard_starts, strict=True)]
        else:
            owned = [layout.shard_range(b, rank) if policy.shard_optimizer else (b.offset, b.padded)
                     for b in layout.buckets]
        self.flat = self.sharded.partition if self.sharded is not None else \
            torch.zeros(layout.numel, dtype=dtype, device=device)
        self._place_master(policy, device, aio, config)
        self._fill(model, params, policy)
        self.stage3 = None if self.sharded is None else self.sharded.attach(  # (the master as it is then)
            on_modified=lambda b, v: shard_modified(self.master, self.nvme, self.shard_starts, b, v),
            shards=self.nvme if on_disk else None,
            gatherer=UnitGathers(group, quantized=policy.zeropp.quantized_weights, hpz=policy.zeropp.hpz_partition_size))
        frozen = partitioned_frozen(model, policy.shard_params, dtype, managed)  # stage 3: partitioned too (_frozen)
        self.frozen = FrozenShards(model, frozen, config, group, dtype, self.stage3,
                                   quantized=policy.zeropp.quantized_nontrainable_weights) if frozen else None
        # the optimizer steps one tensor per run: a bucket's stepped range, split where the option group
        # changes (one run per bucket without param_groups); (bucket, offset in the range, length, group)
        self.runs = step_runs(layout, policy.shard_optimizer, rank, group_of)
        # where each parameter's pieces live (the master copy is laid out as the partition when it is one)
        self.records = build_records(layout, params, rank, sharded=policy.shard_optimizer,
                                     master_in_partition=policy.shard_optimizer and (
                                         self.master is not None or policy.shard_params),
                                     shard_starts=self.shard_starts, runs=self.runs, groups=self.bucket_groups)
        # where each bucket's stepped part lives in the master copy (the flat buffer itself in float32)
        if self.master is None or not policy.shard_optimizer:
            in_master = owned
        else:
            in_master = [(at, b.shard) for b, at in zip(layout.buckets, self.shard_starts, strict=True)]
        # stages 0-1: every .grad a view of one flat buffer, which backward accumulates into (`_grad_slots`)
        self.grads = torch.zeros(layout.numel, dtype=dtype, device=device) if policy.whole_grads else None
        self.partition: torch.Tensor | None = None
        if not policy.shard_optimizer:
            self.shard_grads = [self.grads[start:start + length] for start, length in owned]
        else:  # stage 1 too: each reduction averages the whole local accumulation into the partition anew
            self.partition = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
            self.shard_grads = [self.partition[at:at + b.shard] for b, at in zip(layout.buckets, self.shard_starts,
                                                                                 strict=True)]
        if self.host is not None:  # where each bucket's reduced gradients land, where its parameters are stepped
            self.host.bind(list(self.shard_grads), [self.flat[at:at + n] for at, n in owned])
        # per bucket above (what its reduction writes), per run below (what the optimizer steps)
        self.step_grads = [self.shard_grads[b][at:at + n] for b, at, n, _ in self.runs]
        self.in_master = [(in_master[b][0] + at, n) for b, at, n, _ in self.runs]
        self.on_host = [(self.host.places[b][0] + at, n) for b, at, n, _ in self.runs] if self.host is not None else []
        self.owned = [(owned[b][0] + at, n) for b, at, n, _ in self.runs]
        self.pieces = layout.pieces(rank)  # for the gradient norm at stages 1-2
        master, stepped = (self.flat if self.master is None else self.master), self.in_master
        if self.host is not None and self.host.master is not None:  # ZeRO-Offload: the host's copy is stepped
            master, stepped = self.host.master, self.on_host
        self.step_params = [nn.Parameter(master[at:at + n], requires_grad=True) for at, n in stepped]
        self.recipe = self.copies = self.master_grads = self.host_copies = None
        self.host_grads: list[torch.Tensor] = []
        self.grad_views: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _place_master(self, policy: ZeroPolicy, device: torch.device, aio: Any, config: Any) -> None:
        """The master copy: on the host under ZeRO-Offload (float32 for a float32 model too; bf16 master
        weights: the host mirrors the partition), on NVMe under ZeRO-Infinity, float32 on the device for a
        16-bit model, none otherwise (the flat parameters are the master)."""
        layout, dtype = self.layout, self.dtype
        self.master: torch.Tensor | None = None
        self.host: HostOffload | None = None
        master_numel = layout.shard_numel if policy.shard_optimizer else layout.numel
        if policy.offload:
            self.host = HostOffload(device, master_numel, host_places(layout, policy.shard_optimizer, self.shard_starts),
                                    dtype=dtype, master_dtype=None if policy.offload_device == "nvme" else
                                    dtype if policy.bf16_master else torch.float32, mirror=policy.bf16_master)
            self.master = None if policy.bf16_master else self.host.master
        elif dtype != torch.float32 and not policy.bf16_master:
            self.master = torch.zeros(master_numel, dtype=torch.float32, device=device)
        self.nvme: NvmeOptimizer | None = None  # Adam's states (and the master copy) on NVMe
        if policy.offload_device == "nvme":
            nvme = config.offload_optimizer
            self.nvme = NvmeOptimizer(layout.shard_numel, sub_group_size=config.sub_group_size,
                                      master=dtype != torch.float32, nvme_path=nvme.nvme_path, aio=aio,
                                      rank=self.rank, pipeline_read=nvme.pipeline_read,
                                      pipeline_write=nvme.pipeline_write,
                                      param_dtype=dtype if policy.params_on_nvme else None)

    def _fill(self, model: nn.Module, params: list[nn.Parameter], policy: ZeroPolicy) -> None:
        """The parameters' values into the flat buffer (and master copy), each parameter a view of it; with
        a 16-bit model the rest of it (frozen parameters, buffers) cast too."""
        if self.sharded is not None:  # this rank's shards (and master copy), the parameters released
            self.sharded.fill(master=self.master, clear_grads=True, on_disk=self.nvme.write_params
                              if self.nvme is not None and self.nvme.param_dtype is not None else None)
        else:
            if self.master is not None:
                fill_master(self.master, params, self.layout, self.rank, sharded=policy.shard_optimizer,
                            dtype=self.dtype)
            for p, slot in zip(params, self.layout.slots, strict=True):
                view = self.flat[slot.offset:slot.offset + slot.numel].view(p.shape)
                view.copy_(p.detach())
                p.data = view
                p.grad = None
        if policy.cast_model:  # the rest of the model (frozen parameters, buffers) too
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.is_floating_point() and tensor.dtype != self.dtype and not hasattr(tensor, "ds_init_store"):
                    tensor.data = tensor.data.to(self.dtype)
            if policy.auto_cast:
                self.hooks.append(model.register_forward_pre_hook(cast_floating_inputs(self.dtype), with_kwargs=True))

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The second half, once ``optimizer`` is built over ``step_params`` (see the module docstring)."""
        if self.nvme is not None:  # the parameters on NVMe are in their file already
            self.nvme.initialize(None if self.policy.params_on_nvme else self.flat)
            if self.policy.params_on_nvme:
                self.flat.untyped_storage().resize_(0)
        # the fused path: 16-bit models and CPU offload step Adam-family optimizers with ds_ops.adam_step
        self.recipe = adam_recipe(optimizer) if (self.master is not None or self.policy.offload) else None
        self.copies = None if self.master is None else [self.flat[s:s + n] for s, n in self.owned]
        self.master_grads = None  # float32 gradients for a non-Adam optimizer of a 16-bit model
        if self.master is not None and self.recipe is None:
            self.master_grads = torch.zeros_like(self.master, device=self.master.device)
        # ZeRO-Offload: the CPU Adam reads the gradients copied to the host, writes the new parameters there
        self.host_grads, self.host_copies = self.host.views(self.on_host) if self.host is not None else ([], None)
        self.grad_views = step_grad_views(self.step_params, self.host_grads if self.host is not None else
                                          self.step_grads, self.in_master, self.master_grads)
        self.point_step_grads()

    @property
    def frozen_stage3(self) -> Any:
        """Stage 3's partitioned frozen parameters' `Stage3`, or None."""
        return self.frozen.stage3 if self.frozen is not None else None

    def point_step_grads(self) -> None:
        """Each tensor the optimizer steps has its gradient slice as ``.grad`` (again: the client optimizer's
        ``zero_grad()`` sets them to None, as DeepSpeed's ZeRO points them again at every step)."""
        for tensor, grad in self.grad_views:
            tensor.grad = grad

    def refresh_parameters(self) -> None:
        """After the stepped part changed: every rank's shards into the parameters (stages 1-2), or
        into the units gathered now (stage 3: the others are gathered when used)."""
        if self.stage3 is not None:
            self.stage3.after_step()
        elif self.policy.shard_optimizer:
            gather_buckets(self.flat, self.layout.buckets, self.bucket_groups)

    def master_loaded(self) -> None:
        """The master copy was written (a load): the 16-bit parameters follow it, every rank's are refreshed."""
        if self.master is not None:
            for copy, tensor in zip(self.copies, self.step_params, strict=True):
                copy.copy_(tensor.detach())
        if self.nvme is not None and self.nvme.master:  # 16-bit parameters from the master copy on disk
            self.nvme.params_from_master(self.flat if self.nvme.param_dtype is None else None)
        self.refresh_parameters()

    def zero_grads(self) -> None:
        """The accumulated gradients zeroed (stages 0-1's flat buffer, the partition); at stages 2-3 each
        parameter's ``.grad`` None."""
        if self.grads is not None:
            self.grads.zero_()
        if self.partition is not None:
            self.partition.zero_()
        if self.policy.shard_grads:
            for p in self.params:
                p.grad = None

    def close(self, optimizer: torch.optim.Optimizer) -> None:
        """Every parameter whole again (stage 3: a collective), NVMe's files closed, the gradients, the
        optimizer's states and the master copy freed."""
        if self.host is not None:
            self.host.forget_downloads()
        for stage3 in (self.stage3, self.frozen_stage3):
            if stage3 is not None:  # every parameter whole again (a collective: every rank closes)
                stage3.gather_all()
        if self.nvme is not None:
            self.nvme.close()
            self.nvme = None
        for p in self.params:
            p.grad = None
        for tensor in self.step_params:
            tensor.grad = None
        optimizer.state.clear()
        self.grads = self.partition = self.master = self.master_grads = None
        self.step_grads, self.copies = [], None
        self.shard_grads, self.host_grads, self.host_copies, self.host = [], [], None, None
        self.grad_views = []
