"""Messages between stages split across tensor-parallel ranks (DeepSpeed's ``pipe_partitioned`` and
``grad_partitioned``).

With tensor-parallel stages (Megatron's layers: a row-parallel layer all-reduces its output) the activation a
stage sends is the same whole tensor on every tensor-parallel rank, and so is the gradient sent back (a
column-parallel layer all-reduces its input's gradient). Each tensor-parallel rank then sends only its
``1 / tp`` part of the first tensor (flattened, padded to a multiple of ``tp``), with its shape, to the rank
of the same slice on the neighbouring stage, which all-gathers the parts over its tensor-parallel group:
``tp`` times fewer bytes between stages, for an all-gather between neighbours. The other tensors of a
message travel whole.
"""

from __future__ import annotations

import torch

import ds_comm


def split_first(tensors: tuple[torch.Tensor, ...], rank: int, size: int) -> tuple[torch.Tensor, ...]:
    """``(part, shape, *rest)``: this rank's part of ``tensors[0]`` (keeping its ``requires_grad``, which
    the message carries) and the whole tensor's shape."""
    first = tensors[0]
    if not isinstance(first, torch.Tensor):
        raise ValueError(f"ds_pipe: a stage's output must be a tensor or a tuple of tensors, got "
                         f"{type(first).__name__}")
    flat = first.reshape(-1)
    chunk = -(-flat.numel() // size)
    if chunk * size != flat.numel():
        flat = torch.cat([flat, flat.new_zeros(chunk * size - flat.numel())])
    part = flat[rank * chunk:(rank + 1) * chunk]
    shape = torch.tensor(list(first.shape), dtype=torch.int64, device=first.device)
    return (part, shape, *tensors[1:])


def join_first(tensors: tuple[torch.Tensor, ...], group, size: int) -> tuple[torch.Tensor, ...]:
    """The message of `split_first` whole again: the parts all-gathered over the tensor-parallel ``group``
    into the first tensor (a leaf that requires grad when the sender's did)."""
    part, shape, *rest = tensors
    wire = part.detach()
    if wire.dtype == torch.bool:  # collectives move numbers
        wire = wire.to(torch.uint8)
    gathered = torch.empty(size * wire.numel(), dtype=wire.dtype, device=wire.device)
    ds_comm.all_gather_into_tensor(gathered, wire.contiguous(), group=group)
    dims = [int(d) for d in shape.tolist()]
    numel = 1
    for d in dims:
        numel *= d
    whole = gathered[:numel].reshape(dims).to(part.dtype).detach()  # a leaf of its own
    return (whole.requires_grad_() if part.requires_grad else whole, *rest)
