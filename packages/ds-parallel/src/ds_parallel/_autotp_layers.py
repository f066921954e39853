"""AutoTP's replacement layers: DeepSpeed's ``LinearLayer`` (column-parallel) and ``LinearAllreduce``
(row-parallel), built from an existing ``nn.Linear`` or a Hugging Face ``Conv1D`` (GPT-2's transposed
linear) whose parameters they slice in place.

The replaced parameter objects are kept (their ``.data`` becomes this rank's shard), so the Hugging Face
state-dict keys stay (``...q_proj.weight``). The shard is always stored in ``nn.Linear`` layout
(``[out, in]``); a layer built from a ``Conv1D`` remembers it, and `LinearLayer.gathered_state` gives the
full tensors back in the ``Conv1D`` layout (``[in, out]``).

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
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

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


def _set_shard(param: nn.Parameter, shard: torch.Tensor) -> None:
    with torch.no_grad():
        param.data = shard


def _mark(param: nn.Parameter, dim: int, stride: int) -> None:
    set_tensor_model_parallel_attributes(param, True, dim, stride)
    setattr(param, DS_IS_REPLACED_MODULE, True)


class _TPLinear(nn.Module):
    """Shared part of `LinearLayer` and `LinearAllreduce`."""

    _dim = 0  # the weight dimension (in [out, in] layout) this layer slices

    def __init__(self, module: nn.Module, mp_group, skip_partition: bool, name: str | None, partition_stride: int):
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
        self.weight = module.weight
        self.bias = module.bias
        if not skip_partition:
            _set_shard(self.weight, _strided_shard(weight, self._dim, self.tp_world_size, self.tp_index,
                                                   partition_stride, what))
            if bias is not None and self._dim == 0:
                _set_shard(self.bias, _strided_shard(bias, 0, self.tp_world_size, self.tp_index,
                                                     partition_stride, what))
        elif conv1d:
            _set_shard(self.weight, weight.contiguous())
        _mark(self.weight, self._dim, partition_stride)
        if self.bias is not None and self._dim == 0:
            _mark(self.bias, 0, partition_stride)
        self.out_features, self.in_features = self.weight.shape
        if self._dim == 0:
            self.out_features *= self.tp_world_size
        else:
            self.in_features *= self.tp_world_size

    def gathered_state(self) -> dict[str, torch.Tensor]:
        """``{"weight": full, "bias": full}`` (no "bias" without one) in the layout of the module that was
        replaced (``Conv1D``: [in, out]). A collective over the layer's group: call it on every rank."""
        full = _strided_gather(self.weight, self._dim, self.mp_group, self.tp_world_size, self.partition_stride)
        state = {"weight": full.t().contiguous() if self.conv1d else full}
        if self.bias is not None:
            state["bias"] = (_strided_gather(self.bias, 0, self.mp_group, self.tp_world_size, self.partition_stride)
                             if self._dim == 0 else self.bias.detach().clone())
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
                 *, name: str | None = None, partition_stride: int = 1):
        super().__init__(module, mp_group, skip_partition, name, partition_stride)
        if gather_output and partition_stride != 1:
            raise ValueError(f"LinearLayer {name}: gather_output needs partition_stride 1, got {partition_stride}")
        self.gather_output = gather_output

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        input = copy_to_tensor_model_parallel_region(input, self.mp_group)
        output = F.linear(input, self.weight, self.bias)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.mp_group)
        return output


class LinearAllreduce(_TPLinear):
    """Row-parallel replacement of an ``nn.Linear`` / ``Conv1D`` (DeepSpeed's ``LinearAllreduce``): this rank
    holds its share of the input features (weight columns); the input is this rank's share (the output of
    a `LinearLayer`), the partial products are all-reduced over ``mp_group``
    (``reduce_from_tensor_model_parallel_region``) and the replicated bias is added after."""

    _dim = 1

    def __init__(self, module: nn.Module, mp_group=None, skip_partition: bool = False, *, name: str | None = None,
                 partition_stride: int = 1):
        super().__init__(module, mp_group, skip_partition, name, partition_stride)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = reduce_from_tensor_model_parallel_region(F.linear(input, self.weight), self.mp_group)
        if self.bias is not None:
            output = output + self.bias
        return output
