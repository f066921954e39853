"""Plain functions that fill `ZeroOptimizer`'s buffers and check its optimizer: the master copy from the
model's parameters (stage 3's partitions: `ShardedParams`), a modified stage-3 shard into the master copy,
whether the optimizer can step ZeRO's flat tensors, and what ZeRO-Infinity's files rule out."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._precision import adam_recipe, needs_whole_tensors


def refuse_with_nvme(nvme: Any, what: str) -> None:
    if nvme is not None:
        raise NotImplementedError(f"ZeroOptimizer.{what} with offload_optimizer.device 'nvme': its states are in "
                                  f"files under {nvme.directory}, larger than RAM may hold; use "
                                  "save_zero_checkpoint / load_zero_checkpoint, which stream them")


def check_optimizer(optimizer: torch.optim.Optimizer, offload: bool) -> None:
    why = needs_whole_tensors(optimizer)
    if why is not None:
        raise ValueError(f"ZeroOptimizer: {type(optimizer).__name__} cannot step ZeRO's flat partitions: "
                         f"{why}; use an optimizer whose update is elementwise (Adam, AdamW, SGD, Adagrad, ...)")
    if offload and adam_recipe(optimizer) is None:
        raise ValueError(f"zero_optimization.offload_optimizer steps Adam or AdamW on the CPU (ds_ops' CPU Adam); "
                         f"got {type(optimizer).__name__}: use torch.optim.Adam/AdamW (without amsgrad or "
                         "maximize) or ds_ops.CPUAdam")


def fill_master(master: torch.Tensor, params: list[nn.Parameter], layout: Any, rank: int, *, sharded: bool,
                dtype: torch.dtype) -> None:
    """The master copy (laid out as the whole layout, or as ``rank``'s partition with ``sharded`` optimizer
    states) from the parameters in the model's 16-bit ``dtype``, widened: DeepSpeed's engine casts the model to
    fp16/bf16 before it takes the float32 copy, so training starts from the same values."""
    if not sharded:
        for p, slot in zip(params, layout.slots, strict=True):
            master[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1).to(dtype))
        return
    for piece in layout.pieces(rank):
        source = params[piece.index].detach().reshape(-1)[piece.param_offset:piece.param_offset + piece.numel]
        master[piece.partition_offset:piece.partition_offset + piece.numel].copy_(source.to(dtype))


def shard_modified(master: torch.Tensor | None, nvme: Any, shard_starts: list[int], bucket: int,
                   values: torch.Tensor) -> None:
    """GatheredParameters changed stage 3's shard of unit ``bucket`` to ``values``: the master copy (in RAM, or
    ZeRO-Infinity's file) follows."""
    start = shard_starts[bucket]
    if master is not None:
        master[start:start + values.numel()].copy_(values)
    elif nvme is not None and nvme.master:
        nvme.write_range("master", start, values.float())
