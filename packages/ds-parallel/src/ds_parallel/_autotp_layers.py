"""AutoTP's replacement layers: DeepSpeed's ``LinearLayer`` (column-parallel) and ``LinearAllreduce``
(row-parallel), built from an existing ``nn.Linear`` or a Hugging Face ``Conv1D`` (GPT-2's transposed
linear) whose parameters they slice in place.

The replaced parameter objects are kept (their ``.data`` becomes this rank's shard), so the Hugging Face
state-dict keys stay (``...q_proj.weight``). The shard is always stored in ``nn.Linear`` layout
(``[out, in]``); a layer built from a ``Conv1D`` remembers it, and `LinearLayer.gathered_state` gives the
full tensors back in the ``Conv1D`` layout (``[in, out]``).

Shards: with ``partition_stride`` 1 the sliced dimension is split by DeepSpeed's rules (`get_shard_size_list`
of the layer's name: near-even, the first ranks one more when the group size does not divide it), or by the
``partition_sizes`` given; ``partition_sizes`` holds the result, in rank order. A fused weight
(``partition_stride`` > 1) must divide evenly.

Marks (Megatron's names, read by ds-zero / ds-all): every sliced parameter gets
``tensor_model_parallel = True``, ``partition_dim`` (0: output features, 1: input features, in the
``nn.Linear`` layout the parameter holds) and ``partition_stride`` (1, or the number of fused
sub-matrices, e.g. 3 for GPT-2's ``c_attn`` = [q; k; v]: the dimension is cut in ``stride * tp_size``
equal chunks and rank r holds chunks r, r + tp_size, r + 2 tp_size ...). The bias of a row-parallel
layer is replicated and unmarked.

``mp_group=None`` means the default process group (the ds convention of `ds_parallel`'s mappings; with
no process group at all the layer is a single-rank identity). DeepSpeed's layers read ``None`` as "no
tensor parallelism": pass a group explicitly when that matters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ds_comm

from ._layers import set_tensor_model_parallel_attributes
from ._mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from ._shard import get_shard_size_list

DS_IS_REPLACED_MODULE = "ds_is_replaced_module"


def group_world_rank(group) -> tuple[int, int]:
    """(world size, rank) of ``group`` (None: the default group; no process group: (1, 0))."""
    if group is None and not dist.is_initialized():
        return 1, 0
    return ds_comm.get_world_size(group), ds_comm.get_rank(group)


def is_conv1d(module: nn.Module) -> bool:
    """A Hugging Face ``Conv1D`` (GPT-2, GPT): ``weight`` [in, out], ``y = x @ weight + bias``. Recognised
    by class name and shape so ds-parallel does not import transformers."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and weight.shape[1] == getattr(module, "nf", -1))


def _linear_layout(module: nn.Module, what: str) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(weight in [out, in] layout, bias, built from Conv1D?) of an ``nn.Linear`` or ``Conv1D``."""
    if isinstance(module, nn.Linear):
        return module.weight.detach(), (module.bias.detach() if module.bias is not None else None), False
    if is_conv1d(module):
        return module.weight.detach().t(), (module.bias.detach() if module.bias is not None else None), True
    raise ValueError(f"{what}: module must be an nn.Linear or a Hugging Face Conv1D, got {type(module).__name__}")


def _strided_shard(tensor: torch.Tensor, dim: int, world: int, rank: int, stride: int, what: str) -> torch.Tensor:
    """This rank's share of ``tensor`` along ``dim``: cut in ``stride * world`` chunks, keep chunks
    ``rank + k * world`` (k < stride), concatenated (Megatron's strided partition)."""
    size = tensor.shape[dim]
    if size % (stride * world):
        raise ValueError(f"{what}: dimension {dim} of size {size} is not divisible by tp_size {world}"
                         + (f" × {stride} fused parts" if stride > 1 else ""))
    chunk = size // (stride * world)
    parts = [tensor.narrow(dim, (k * world + rank) * chunk, chunk) for k in range(stride)]
    return torch.cat(parts, dim=dim).contiguous()


def _strided_gather(shard: torch.Tensor, dim: int, group, world: int, stride: int) -> torch.Tensor:
    """Inverse of `_strided_shard`: all-gather every rank's shard (collective over ``group``)."""
    if world == 1:
        return shard.detach().clone()
    local = shard.detach().contiguous()
    out = torch.empty((world, *local.shape), dtype=local.dtype, device=local.device)
    ds_comm.all_gather_into_tensor(out, local, group=group)
    # [world, ..., stride * c, ...] -> [world, ..., stride, c, ...] -> [..., stride, world, c, ...]
    d = dim + 1
    chunk = local.shape[dim] // stride
    split = out.reshape(*out.shape[:d], stride, chunk, *out.shape[d + 1:])
    moved = split.movedim(0, d)  # world goes right after stride
    full_shape = list(local.shape)
    full_shape[dim] = local.shape[dim] * world
    return moved.reshape(full_shape).contiguous()


def _uneven_shard(tensor: torch.Tensor, dim: int, sizes: tuple[int, ...], rank: int) -> torch.Tensor:
    return tensor.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()


def _uneven_gather(shard: torch.Tensor, dim: int, group, sizes: tuple[int, ...]) -> torch.Tensor:
    """Every rank's ``shard`` (sizes ``sizes`` along ``dim``) concatenated in rank order: each is padded to the
    largest so one all-gather carries them (collective over ``group``)."""
    if len(sizes) == 1:
        return shard.detach().clone()
    local = shard.detach()
    widest = max(sizes)
    padded_shape = list(local.shape)
    padded_shape[dim] = widest
    padded = local.new_zeros(padded_shape)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    out = local.new_empty((len(sizes), *padded_shape))
    ds_comm.all_gather_into_tensor(out, padded, group=group)
    return torch.cat([out[r].narrow(dim, 0, size) for r, size in enumerate(sizes)], dim=dim).contiguous()


class _GatherOutput(torch.autograd.Function):
    """All-gather the last dimension of a column-parallel output whose shards have sizes ``sizes`` (rank
    order); backward keeps this rank's part of the gradient."""

    @staticmethod
    def forward(ctx, input_: torch.Tensor, group, sizes: tuple[int, ...], rank: int) -> torch.Tensor:
        ctx.offset, ctx.size = sum(sizes[:rank]), sizes[rank]
        if input_.shape[-1] != sizes[rank]:
            raise ValueError(f"LinearLayer: rank {rank} produced {input_.shape[-1]} output features, its shard "
                             f"has {sizes[rank]}")
        return _uneven_gather(input_, input_.dim() - 1, group, sizes)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output.narrow(-1, ctx.offset, ctx.size).contiguous(), None, None, None


def _set_shard(param: nn.Parameter, shard: torch.Tensor) -> None:
    with torch.no_grad():
        param.data = shard


def _mark(param: nn.Parameter, dim: int, stride: int) -> None:
    set_tensor_model_parallel_attributes(param, True, dim, stride)
    setattr(param, DS_IS_REPLACED_MODULE, True)


class _TPLinear(nn.Module):
    """Shared part of `LinearLayer` and `LinearAllreduce`."""

    _dim = 0  # the weight dimension (in [out, in] layout) this layer slices

    def __init__(self, module: nn.Module, mp_group, skip_partition: bool, name: str | None, partition_stride: int,
                 partition_sizes=None):
        super().__init__()
        kind = type(self).__name__
        if not isinstance(partition_stride, int) or isinstance(partition_stride, bool) or partition_stride < 1:
            raise ValueError(f"{kind}: partition_stride must be an int >= 1, got {partition_stride!r}")
        weight, bias, conv1d = _linear_layout(module, kind)
        self.mp_group = mp_group
        self.tp_world_size, self.tp_index = group_world_rank(mp_group)
        self.name = name
        self.partition_stride = partition_stride
        self.conv1d = conv1d  # gathered_state restores the Conv1D layout [in, out]
        what = f"{kind} {name or type(module).__name__}"
        full = weight.shape[self._dim]  # the sliced dimension, whole (skip_partition: this rank's shard)
        if skip_partition:
            full *= self.tp_world_size  # the shard given is taken as an even share
        self.partition_sizes = self._sizes(full, partition_sizes, what)
        self.weight = module.weight
        self.bias = module.bias
        if not skip_partition:
            _set_shard(self.weight, self._shard(weight, self._dim, what))
            if bias is not None and self._dim == 0:
                _set_shard(self.bias, self._shard(bias, 0, what))
        elif conv1d:
            _set_shard(self.weight, weight.contiguous())
        _mark(self.weight, self._dim, partition_stride)
        if self.bias is not None and self._dim == 0:
            _mark(self.bias, 0, partition_stride)
        self.out_features, self.in_features = self.weight.shape
        if self._dim == 0:
            self.out_features = sum(self.partition_sizes)
        else:
            self.in_features = sum(self.partition_sizes)

    def _sizes(self, full: int, given, what: str) -> tuple[int, ...]:
        world = self.tp_world_size
        if given is not None:
            sizes = tuple(given)
            if (len(sizes) != world or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in sizes)
                    or sum(sizes) != full):
                raise ValueError(f"{what}: partition_sizes must be {world} non-negative integers adding up to "
                                 f"{full} (dimension {self._dim}), got {given!r}")
            if self.partition_stride != 1 and len(set(sizes)) != 1:
                raise ValueError(f"{what}: a fused weight (partition_stride {self.partition_stride}) is split "
                                 f"evenly, got partition_sizes {sizes}")
            return sizes
        if self.partition_stride != 1:
            if full % (self.partition_stride * world):
                raise ValueError(f"{what}: dimension {self._dim} of size {full} is not divisible by tp_size {world}"
                                 f" × {self.partition_stride} fused parts")
            return (full // world,) * world
        return tuple(get_shard_size_list(full, world, self.name))

    def _shard(self, tensor: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        if self.partition_stride != 1:
            return _strided_shard(tensor, dim, self.tp_world_size, self.tp_index, self.partition_stride, what)
        return _uneven_shard(tensor, dim, self.partition_sizes, self.tp_index)

    def _gather(self, shard: torch.Tensor, dim: int) -> torch.Tensor:
        if self.partition_stride != 1:
            return _strided_gather(shard, dim, self.mp_group, self.tp_world_size, self.partition_stride)
        return _uneven_gather(shard, dim, self.mp_group, self.partition_sizes)

    def gathered_state(self) -> dict[str, torch.Tensor]:
        """``{"weight": full, "bias": full}`` (no "bias" without one) in the layout of the module that was
        replaced (``Conv1D``: [in, out]). A collective over the layer's group: call it on every rank."""
        full = self._gather(self.weight, self._dim)
        state = {"weight": full.t().contiguous() if self.conv1d else full}
        if self.bias is not None:
            state["bias"] = self._gather(self.bias, 0) if self._dim == 0 else self.bias.detach().clone()
        return state

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"tp_size={self.tp_world_size}, partition_dim={self._dim}, partition_stride={self.partition_stride}"
                + (", from Conv1D" if self.conv1d else ""))


class LinearLayer(_TPLinear):
    """Column-parallel replacement of an ``nn.Linear`` / ``Conv1D`` (DeepSpeed's ``LinearLayer``): this rank
    holds its share of the output features (weight rows and bias); the input is replicated, so its gradient
    is all-reduced over ``mp_group`` (``copy_to_tensor_model_parallel_region``); the output is this rank's
    share, or the full output with ``gather_output=True``.

    ``partition_stride`` > 1 slices a fused weight (GPT-2's ``c_attn`` = [q; k; v]: 3) so that each rank
    gets its share of every part. ``skip_partition=True`` takes the module's weights as this rank's shard
    already."""

    _dim = 0

    def __init__(self, module: nn.Module, mp_group=None, skip_partition: bool = False, gather_output: bool = False,
                 *, name: str | None = None, partition_stride: int = 1, partition_sizes=None):
        super().__init__(module, mp_group, skip_partition, name, partition_stride, partition_sizes)
        if gather_output and partition_stride != 1:
            raise ValueError(f"LinearLayer {name}: gather_output needs partition_stride 1, got {partition_stride}")
        self.gather_output = gather_output

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        input = copy_to_tensor_model_parallel_region(input, self.mp_group)
        output = F.linear(input, self.weight, self.bias)
        if self.gather_output:
            output = _GatherOutput.apply(output, self.mp_group, self.partition_sizes, self.tp_index)
        return output


class LinearAllreduce(_TPLinear):
    """Row-parallel replacement of an ``nn.Linear`` / ``Conv1D`` (DeepSpeed's ``LinearAllreduce``): this rank
    holds its share of the input features (weight columns); the input is this rank's share (the output of
    a `LinearLayer`), the partial products are all-reduced over ``mp_group``
    (``reduce_from_tensor_model_parallel_region``) and the replicated bias is added after."""

    _dim = 1

    def __init__(self, module: nn.Module, mp_group=None, skip_partition: bool = False, *, name: str | None = None,
                 partition_stride: int = 1, partition_sizes=None):
        super().__init__(module, mp_group, skip_partition, name, partition_stride, partition_sizes)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = reduce_from_tensor_model_parallel_region(F.linear(input, self.weight), self.mp_group)
        if self.bias is not None:
            output = output + self.bias
        return output
