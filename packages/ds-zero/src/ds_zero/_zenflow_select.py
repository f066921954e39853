"""ZenFlow's column selection and its selective AdamW, as plain functions of explicit tensors.

A weight matrix ``W`` of shape ``[rows, columns]`` is seen as DeepSpeed's ZenFlow sees it: column by column
(``W[:, j]``, one input feature), each column's importance the sum of its gradient's magnitudes. DeepSpeed
lays each parameter group out flat with every matrix transposed (a column contiguous), pads the whole to
``world_size * 2`` elements and splits it into one equal partition per rank; each rank picks, among the
columns lying whole in its partition, the ``max(1, int(columns * topk_ratio))`` most important. `pieces`
computes that split for any world size, so the columns chosen do not depend on how ds lays buffers out.
"""

from __future__ import annotations

import torch

# DeepSpeed's stage 1-2 partitions of a 16-bit group start on multiples of 2 elements (its
# nccl_start_alignment_factor): the group's flat length is padded to world_size * 2.
_ALIGNMENT = 2


def pieces(numels: list[int], world_size: int) -> list[list[tuple[int, int]]]:
    """Per parameter of one group (flattened in order): the ``(offset in the parameter, length)`` of each
    rank partition's part of it, ascending."""
    total = sum(numels)
    unit = world_size * _ALIGNMENT
    padded = -(-total // unit) * unit
    size = padded // world_size
    out, start = [], 0
    for numel in numels:
        parts = []
        for rank in range(world_size):
            low, high = max(start, rank * size), min(start + numel, (rank + 1) * size)
            if low < high:
                parts.append((low - start, high - low))
        out.append(parts)
        start += numel
    return out


def column_count(offset: int, numel: int, rows: int) -> tuple[int, int]:
    """The whole columns in a part ``[offset, offset + numel)`` of a transposed ``[rows, columns]`` matrix:
    ``(first column, number of columns)``."""
    first = -(-offset // rows)
    return first, max(0, (offset + numel) // rows - first)


def selected_count(columns: int, topk_ratio: float) -> int:
    """How many of ``columns`` columns are selected (at least one of a non-empty part)."""
    return 0 if columns == 0 else max(1, int(columns * topk_ratio))


def select_columns(grad: torch.Tensor, parts: list[tuple[int, int]], topk_ratio: float) -> torch.Tensor:
    """The selected columns of a ``[rows, columns]`` matrix from its averaged gradient ``grad``: in each part,
    the ``selected_count`` whole columns of largest summed magnitude, ascending (an int64 index tensor)."""
    rows = grad.shape[0]
    flat = grad.t().contiguous().view(-1)  # DeepSpeed's transposed layout: column j is contiguous
    chosen = []
    for offset, numel in parts:
        first, columns = column_count(offset, numel, rows)
        count = selected_count(columns, topk_ratio)
        if count == 0:
            continue
        sums = flat[first * rows:(first + columns) * rows].view(columns, rows).abs().sum(dim=1)
        top = torch.topk(sums, count).indices + first
        chosen.append(top.sort().values)
    if not chosen:
        return torch.zeros(0, dtype=torch.int64, device=grad.device)
    return torch.cat(chosen).to(torch.int64)


def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           step: torch.Tensor, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One AdamW step in place, in the tensors' own dtype (bf16 for ZenFlow's selected columns), with
    ``torch.optim.AdamW``'s single-tensor arithmetic (the order of its operations, so its rounding);
    ``step`` is a float32 scalar tensor counting the steps, incremented here."""
    beta1, beta2 = betas
    step += 1
    count = float(step)
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    correction1 = 1 - beta1 ** count
    correction2_root = (1 - beta2 ** count) ** 0.5
    denominator = (exp_avg_sq.sqrt() / correction2_root).add_(eps)
    param.addcdiv_(exp_avg, denominator, value=-(lr / correction1))
