"""Tensor-parallel slices in ZeRO's sharded checkpoints: a sliced parameter is saved whole.

A parameter a tensor-parallel layer slices carries Megatron's marks (``tensor_model_parallel = True``,
``partition_dim``, ``partition_stride``): each of the ``size`` ranks of the tensor-parallel group holds
slice ``rank`` of the whole parameter along ``partition_dim``; with ``partition_stride`` s > 1 (a fused
weight: GPT-2's ``c_attn`` = [q; k; v], s = 3) the whole is cut into ``s * size`` chunks along that
dimension and the rank holds chunks ``rank, size + rank, ..., (s - 1) * size + rank`` (Megatron's layout).
In a checkpoint the parameter is the whole one, flattened (the same entries, ``master/<name>`` and
``optim/<key>/<name>``, an unsplit model writes), and a rank's ZeRO piece of its slice is described as the
runs of that flattened whole it covers: each chunk's elements are contiguous in the whole within each
index of the dimensions before ``partition_dim``. So a checkpoint of any tensor-parallel size (1 included, and a model without
tensor-parallel layers) loads at any other: DCP reads the overlapping ranges, as it does for ZeRO's
partitions over data-parallel ranks.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )


@dataclass(frozen=True)
class Slice:
    """Where a tensor-parallel rank's slice sits in the whole parameter."""

    rank: int  # the slice's index (the rank in the tensor-parallel group)
    size: int  # the tensor-parallel world size
    dim: int  # partition_dim
    local_shape: tuple[int, ...]
    stride: int = 1  # partition_stride: the slice is this many chunks of the whole along dim

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.local_shape)
        shape[self.dim] *= self.size
        return tuple(shape)

    @property
    def numel(self) -> int:
        return math.prod(self.full_shape)

    def runs(self, start: int, length: int) -> list[tuple[int, int, int]]:
        """The elements ``start .. start + length`` of the flattened slice as runs of the flattened whole:
        ``(offset in the range, offset in the whole, length)``."""
        inner = math.prod(self.local_shape[self.dim:])  # one index of the outer dims: contiguous in both
        chunk = inner // self.stride  # one of the slice's chunks there: contiguous in the whole too
        whole_inner = inner * self.size
        out, at, end = [], start, start + length
        while at < end:
            outer, within = divmod(at, inner)
            index, within_chunk = divmod(within, chunk)  # chunk `index` of the slice: (index * size + rank) of the whole
            n = min(end - at, chunk - within_chunk)
            out.append((at - start, outer * whole_inner + (index * self.size + self.rank) * chunk + within_chunk, n))
            at += n
        return out


def _group_rank_size(group: Any) -> tuple[int, int]:
    if group is None or not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def tensor_parallel_slices(params: list[torch.Tensor], group: Any) -> dict[int, Slice]:
    """``{index: Slice}`` of the parameters (ZeRO's list) sliced over the tensor-parallel ``group``
    (None, or a group of one rank: nothing is sliced, the marks describe whole tensors)."""
    rank, size = _group_rank_size(group)
    if size == 1:
        return {}
    out = {}
    for index, p in enumerate(params):
        if not getattr(p, "tensor_model_parallel", False):
            continue
        dim = getattr(p, "partition_dim", None)
        if not isinstance(dim, int) or not -p.dim() <= dim < p.dim():
            raise ValueError(f"checkpoint: a parameter of shape {tuple(p.shape)} is marked tensor_model_parallel "
                             f"but its partition_dim is {dim!r}; allowed: an int in 0..{p.dim() - 1}")
        stride = getattr(p, "partition_stride", 1)
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1 or p.shape[dim] % stride:
            raise ValueError(f"checkpoint: a parameter of shape {tuple(p.shape)} is marked tensor_model_parallel "
                             f"with partition_stride {stride!r}; allowed: an int >= 1 that divides its size "
                             f"{p.shape[dim]} along partition_dim {dim}")
        out[index] = Slice(rank, size, dim % p.dim(), tuple(p.shape), stride)
    return out


def sharded_slice(local: torch.Tensor | None, start: int, piece: Slice, dtype: torch.dtype, rank: int,
                  world: int) -> ShardedTensor:
    """A 1-D `ShardedTensor` of the whole parameter whose local shards are ``local`` (elements
    ``start ..`` of this rank's flattened slice; None: no element) cut into its runs of the whole. The
    rest of the whole is listed on another rank: DCP reads and writes local shards only, and the global
    list only has to cover the tensor."""
    shards, metas, covered = [], [], []
    if local is not None and local.numel():
        for offset, at, n in piece.runs(start, local.numel()):
            meta = ShardMetadata([at], [n], f"rank:{rank}/cpu")
            shards.append(Shard(local[offset:offset + n], meta))
            metas.append(meta)
            covered.append((at, n))
    other = (rank + 1) % world
    position = 0
    for at, n in [*sorted(covered), (piece.numel, 0)]:
        if at > position:
            metas.append(ShardMetadata([position], [at - position], f"rank:{other}/cpu"))
        position = at + n
    properties = TensorProperties.create_from_tensor(torch.empty(0, dtype=dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, ShardedTensorMetadata(metas, torch.Size([piece.numel]), properties))


def checkpoint_slices(zero: Any, group: Any, on_nvme: bool) -> dict[int, Slice]:
    """The tensor-parallel slices among ``zero``'s parameters (none without a group of several ranks);
    what this module does not build is refused by name."""
    params = [record.param for record in zero.internals.records]
    tp = tensor_parallel_slices(params, group)
    if not tp and _group_rank_size(group)[1] == 1:
        return tp
    trainable = {id(p) for p in params}
    frozen = [name for name, p in zero.model.named_parameters()
              if id(p) not in trainable and getattr(p, "tensor_model_parallel", False)]
    if frozen:
        raise NotImplementedError(f"checkpoints of frozen tensor-parallel slices ({', '.join(frozen[:3])}) are not "
                                  "implemented in ds-zero: only trainable slices are saved as their whole parameter")
    if tp and on_nvme:
        raise NotImplementedError("checkpoints of tensor-parallel slices with ZeRO-Infinity (offload_optimizer.device "
                                  "nvme) are not implemented in ds-zero; offload the optimizer to cpu or none")
    return tp
