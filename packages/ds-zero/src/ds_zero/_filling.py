"""The internals of `ZeroOptimizer` that fill its buffers and check its optimizer: the master copy and
stage 3's partitions from the model's parameters, a modified stage-3 shard into the master copy, where an
element of a bucket is stepped, and whether the optimizer can step ZeRO's flat tensors. A mixin:
`ZeroOptimizer` owns the state."""

from __future__ import annotations

import bisect

import torch
from torch import nn

from ._model import forget_init_partition, gather_init_partitioned
from ._precision import adam_recipe, needs_whole_tensors


class Filling:
    """See the module docstring."""

    def _refuse_with_nvme(self, what: str) -> None:
        if self._nvme is not None:
            raise NotImplementedError(f"ZeroOptimizer.{what} with offload_optimizer.device 'nvme': its states are in "
                                      f"files under {self._nvme.directory}, larger than RAM may hold; use "
                                      "save_zero_checkpoint / load_zero_checkpoint, which stream them")

    def _step_position(self, bucket: int, offset: int) -> tuple[int, int]:
        """(index of the stepped tensor, offset in it) of element ``offset`` of ``bucket``'s stepped range."""
        starts = self._run_starts[bucket]
        i = bisect.bisect_right(starts, (offset, len(self._runs))) - 1
        return starts[i][1], offset - starts[i][0]

    def _check_optimizer(self) -> None:
        why = needs_whole_tensors(self.optimizer)
        if why is not None:
            raise ValueError(f"ZeroOptimizer: {type(self.optimizer).__name__} cannot step ZeRO's flat partitions: "
                             f"{why}; use an optimizer whose update is elementwise (Adam, AdamW, SGD, Adagrad, ...)")
        if self.offload and adam_recipe(self.optimizer) is None:
            raise ValueError(f"zero_optimization.offload_optimizer steps Adam or AdamW on the CPU (ds_ops' CPU Adam); "
                             f"got {type(self.optimizer).__name__}: use torch.optim.Adam/AdamW (without amsgrad or "
                             "maximize) or ds_ops.CPUAdam")

    def _fill_master(self, params: list[nn.Parameter]) -> None:
        """The master copy from the parameters in the model's 16-bit dtype, widened: DeepSpeed's engine casts
        the model to fp16/bf16 before it takes the float32 copy, so training starts from the same values."""
        if not self.policy.shard_optimizer:
            for p, slot in zip(params, self.layout.slots, strict=True):
                self._master[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1).to(self.dtype))
            return
        for piece in self.layout.pieces(self.rank):
            source = params[piece.index].detach().reshape(-1)[piece.param_offset:piece.param_offset + piece.numel]
            self._master[piece.partition_offset:piece.partition_offset + piece.numel].copy_(source.to(self.dtype))

    def _fill_partitions(self, params: list[nn.Parameter]) -> None:
        """Stage 3: this rank's shard of every unit into the partition (and the master copy), one unit
        whole at a time (parameters built under `Init` are gathered from their shards for it), then
        every parameter is released (the `Stage3` hooks gather them to run). Parameters on NVMe: each
        unit's shard is written to its place in the file (RAM never holds the partition)."""
        on_disk = self._nvme is not None and self._nvme.param_dtype is not None
        for bucket, start in zip(self.layout.buckets, self._shard_starts, strict=True):
            lo, hi = bucket.offset + self.rank * bucket.shard, bucket.offset + (self.rank + 1) * bucket.shard
            shard = torch.zeros(bucket.shard, dtype=self.dtype, device="cpu") if on_disk else \
                self._flat[start:start + bucket.shard]  # (on the host with offload_param)
            for index in bucket.slots:
                slot, p = self.layout.slots[index], params[index]
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a >= b:
                    if hasattr(p, "ds_init_shard"):  # every rank takes part in the gather
                        gather_init_partitioned(p, self.group)
                    continue
                whole = gather_init_partitioned(p, self.group) if hasattr(p, "ds_init_shard") else p.detach()
                source = whole.reshape(-1)[a - slot.offset:b - slot.offset]
                shard[a - lo:b - lo].copy_(source)
                if self._master is not None:  # from the 16-bit values, as DeepSpeed's (see _fill_master)
                    self._master[start + a - lo:start + b - lo].copy_(source.to(self.dtype))
                p.grad = None
            if on_disk:
                self._nvme.write_params(start, shard)
            for index in bucket.slots:  # released: an empty tensor on the model's device
                params[index].data = torch.empty(0, dtype=self.dtype, device=self.device)
                forget_init_partition(params[index])

    def _shard_modified(self, bucket: int, values: torch.Tensor) -> None:
        """GatheredParameters changed a unit's shard to ``values``: the master copy follows."""
        start = self._shard_starts[bucket]
        if self._master is not None:
            self._master[start:start + values.numel()].copy_(values)
        elif self._nvme is not None and self._nvme.master:
            self._nvme.write_range("master", start, values.float())
