"""The internals of `ZeroOptimizer` that fill its buffers and check its optimizer: the master copy from the
model's parameters (stage 3's partitions: `ShardedParams`), a modified stage-3 shard into the master copy, and
whether the optimizer can step ZeRO's flat tensors. A mixin: `ZeroOptimizer` owns the state."""

from __future__ import annotations

import torch
from torch import nn

from ._precision import adam_recipe, needs_whole_tensors


class Filling:
    """See the module docstring."""

    def _refuse_with_nvme(self, what: str) -> None:
        if self._nvme is not None:
            raise NotImplementedError(f"ZeroOptimizer.{what} with offload_optimizer.device 'nvme': its states are in "
                                      f"files under {self._nvme.directory}, larger than RAM may hold; use "
                                      "save_zero_checkpoint / load_zero_checkpoint, which stream them")

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

    def _shard_modified(self, bucket: int, values: torch.Tensor) -> None:
        """GatheredParameters changed a unit's shard to ``values``: the master copy follows."""
        start = self._shard_starts[bucket]
        if self._master is not None:
            self._master[start:start + values.numel()].copy_(values)
        elif self._nvme is not None and self._nvme.master:
            self._nvme.write_range("master", start, values.float())
