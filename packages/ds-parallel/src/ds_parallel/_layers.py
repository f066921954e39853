"""Megatron's tensor-parallel layers: `ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding`.

Signatures are Megatron's (the ``mpu.layers`` ones, which take no ``config`` object), plus keywords:
``group`` (the tensor-parallel process group; None: the default group), ``params_dtype`` and
``device`` (where the parameters live), ``master_weight_init``. The linear layers' ``forward``
returns ``(output, output_bias)`` as Megatron's: ``output_bias`` is the bias when
``skip_bias_add=True`` (added by the caller), else None.

Initialisation. With ``master_weight_init=True`` (the default, Megatron's ``use_cpu_initialization``
path) every rank draws the whole weight from the default generator with ``init_method`` and keeps its
slice: after ``torch.manual_seed(s)`` the gathered weight equals the weight an unsplit layer gets
after ``torch.manual_seed(s)`` (fp32 draw, then cast to ``params_dtype``). With ``False`` each rank draws
only its slice, inside the model-parallel RNG tracker (Megatron's GPU path: no full weight is ever
allocated; `model_parallel_cuda_manual_seed` first). Biases start at zero, as Megatron's.

Marks (read by ZeRO for the gradient norm and by the checkpoint code): a sliced parameter has
``tensor_model_parallel=True``, ``partition_dim``, ``partition_stride``; the row-parallel bias,
replicated on every rank, has ``tensor_model_parallel=False``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._mappings import (
    _rank,
    _world,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from ._random import get_cuda_rng_tracker

_MARKS = ("tensor_model_parallel", "partition_dim", "partition_stride")


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Mark ``tensor`` (Megatron's helper): sliced along ``dim`` with ``stride`` when ``is_parallel``."""
    for name in _MARKS:
        if hasattr(tensor, name):
            raise RuntimeError(f"set_tensor_model_parallel_attributes: the tensor already has {name!r} set")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, group=None) -> bool:
    """True where ``param`` counts on this rank: sliced parameters everywhere, replicated ones on
    tensor-parallel rank 0 only (Megatron's rule for norms and parameter counts)."""
    return bool(getattr(param, "tensor_model_parallel", False)) or _rank(group) == 0


def divide(numerator: int, denominator: int, what: str = "size",
           by: str = "the tensor-parallel world size") -> int:
    if numerator % denominator:
        raise ValueError(f"ds_parallel: {what} {numerator} is not divisible by {by} {denominator}")
    return numerator // denominator


def _check_positive(layer: str, **sizes) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{layer}: {name} must be a positive int, got {value!r}")


def _init_sliced_weight(weight: nn.Parameter, full_shape: tuple[int, int], partition_dim: int, stride: int,
                        init_method: Callable, group, master_weight_init: bool, keep_master: bool):
    """Initialise ``weight`` (this rank's slice of a ``full_shape`` matrix) and mark it. Returns the
    master weight when ``keep_master`` (and ``master_weight_init``), else None."""
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    per_stride = divide(weight.shape[partition_dim], stride, "the per-rank partition", "stride")
    if not master_weight_init:
        with torch.no_grad(), get_cuda_rng_tracker().fork():
            init_method(weight)
        return None
    world, rank = _world(group), _rank(group)
    master = torch.empty(full_shape, dtype=torch.float32, device=weight.device)
    with torch.no_grad():
        init_method(master)
        master = master.to(weight.dtype)
        pieces = torch.split(master, per_stride, dim=partition_dim)[rank::world]
        weight.copy_(torch.cat(pieces, dim=partition_dim))
    return master if keep_master else None


def _check_stride(layer: str, stride) -> None:
    if not isinstance(stride, int) or isinstance(stride, bool) or stride < 1:
        raise ValueError(f"{layer}: stride must be a positive int, got {stride!r}")


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` ([output_size, input_size]) split along its output dimension: rank
    ``r`` holds rows ``[r*n, (r+1)*n)`` (``n = output_size / world``) and computes its columns of ``Y``.
    ``gather_output=True`` all-gathers ``Y`` on every rank; False leaves each rank its columns (the
    input of a `RowParallelLinear` with ``input_is_parallel=True``)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = True,
                 init_method: Callable = nn.init.xavier_normal_, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False, *,
                 params_dtype: torch.dtype = torch.float32, device=None, group=None,
                 master_weight_init: bool = True):
        super().__init__()
        _check_positive("ColumnParallelLinear", input_size=input_size, output_size=output_size)
        _check_stride("ColumnParallelLinear", stride)
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.skip_bias_add, self.group = gather_output, skip_bias_add, group
        world = _world(group)
        self.output_size_per_partition = divide(output_size, world, "ColumnParallelLinear: output_size")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size,
                                               dtype=params_dtype, device=device))
        self.master_weight = _init_sliced_weight(self.weight, (output_size, input_size), 0, stride, init_method,
                                                 group, master_weight_init, keep_master_weight_for_test)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_parallel = copy_to_tensor_model_parallel_region(input_, self.group)
        bias = None if self.skip_bias_add else self.bias
        output_parallel = F.linear(input_parallel, self.weight, bias)
        output = (gather_from_tensor_model_parallel_region(output_parallel, self.group) if self.gather_output
                  else output_parallel)
        return output, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size} "
                f"({self.output_size_per_partition} per rank), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` ([output_size, input_size]) split along its input dimension: rank
    ``r`` holds columns ``[r*n, (r+1)*n)`` (``n = input_size / world``), multiplies its slice of ``X``
    and the partial results are all-reduced. ``input_is_parallel=True``: ``X`` arrives split (a
    `ColumnParallelLinear`'s output with ``gather_output=False``); False: the whole ``X`` arrives and
    each rank keeps its slice. The bias is replicated and added after the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = False,
                 init_method: Callable = nn.init.xavier_normal_, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False, *,
                 params_dtype: torch.dtype = torch.float32, device=None, group=None,
                 master_weight_init: bool = True):
        super().__init__()
        _check_positive("RowParallelLinear", input_size=input_size, output_size=output_size)
        _check_stride("RowParallelLinear", stride)
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add, self.group = input_is_parallel, skip_bias_add, group
        world = _world(group)
        self.input_size_per_partition = divide(input_size, world, "RowParallelLinear: input_size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition,
                                               dtype=params_dtype, device=device))
        self.master_weight = _init_sliced_weight(self.weight, (output_size, input_size), 1, stride, init_method,
                                                 group, master_weight_init, keep_master_weight_for_test)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, False, -1, 1)  # replicated on every rank
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.input_is_parallel:
            if input_.size(-1) != self.input_size_per_partition:
                raise ValueError(f"RowParallelLinear: with input_is_parallel=True the input's last dimension must "
                                 f"be this rank's {self.input_size_per_partition} features, got {input_.size(-1)}")
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, self.group)
        output = reduce_from_tensor_model_parallel_region(F.linear(input_parallel, self.weight), self.group)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size} ({self.input_size_per_partition} per rank), "
                f"output_size={self.output_size}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}")


def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[first, last)`` of the vocabulary rows rank ``rank`` of ``world_size`` holds (Megatron's VocabUtility)."""
    per_partition = divide(global_vocab_size, world_size, "the vocabulary size")
    return rank * per_partition, (rank + 1) * per_partition


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with the table split along the vocabulary: rank ``r`` holds rows
    ``[r*n, (r+1)*n)`` (``n = num_embeddings / world``), looks up the ids in its range (zeros for the
    others) and the results are all-reduced. ``num_embeddings`` must be divisible by the world size
    (pad the vocabulary, as Megatron's ``make_vocab_size_divisible_by`` does)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, init_method: Callable = nn.init.xavier_normal_, *,
                 params_dtype: torch.dtype = torch.float32, device=None, group=None,
                 master_weight_init: bool = True):
        super().__init__()
        _check_positive("VocabParallelEmbedding", num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.tensor_model_parallel_size = _world(group)
        self.vocab_start_index, self.vocab_end_index = vocab_range_from_global_vocab_size(
            num_embeddings, _rank(group), self.tensor_model_parallel_size)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim,
                                               dtype=params_dtype, device=device))
        _init_sliced_weight(self.weight, (num_embeddings, embedding_dim), 0, 1, init_method, group,
                            master_weight_init, False)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if input_.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"VocabParallelEmbedding: input_ must hold integer token ids (int32/int64), got "
                             f"{input_.dtype}")
        if self.tensor_model_parallel_size == 1:
            return F.embedding(input_, self.weight)
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        output_parallel = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(output_parallel, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows [{self.vocab_start_index}, "
                f"{self.vocab_end_index}) on this rank)")
