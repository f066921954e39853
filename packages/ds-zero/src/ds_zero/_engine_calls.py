"""What DeepSpeed's engine asks of its ZeRO optimizer besides the loop and the offloads: the parameters by
group (``fp16_groups``), a new number of accumulation steps (``engine.set_train_batch_size``), the master
copy taken again from the model's weights after they were loaded into it (``refresh_fp32_params``), and
stage 3's gathered parameters and their buffers given back (``empty_partition_cache``). Plain functions
over explicit arguments; `ZeroOptimizer`'s methods of those names call them."""

from __future__ import annotations

import gc
from typing import Any

from ._filling import fill_master, refuse_with_nvme


def grouped(params: list, group_of: list[int], group_count: int) -> list[list]:
    """``params`` in one list per parameter group (``group_of[i]``: the group of ``params[i]``)."""
    groups: list[list] = [[] for _ in range(group_count)]
    for param, group in zip(params, group_of, strict=True):
        groups[group].append(param)
    return groups


def check_accumulation_steps(steps: Any, *, reduce_in_backward: bool, accumulating: bool) -> int:
    """``steps`` when it may become the number of micro-steps per optimizer step now (``accumulating``: an
    accumulation is under way); a ValueError for a bad value, a RuntimeError mid-accumulation."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be an integer >= 1, got {steps!r}")
    if not reduce_in_backward and steps != 1:
        raise ValueError("ZeroOptimizer: reduce_in_backward=False means the caller accumulates the micro-steps "
                         f"(a pipeline stage); gradient_accumulation_steps must stay 1, got {steps}")
    if accumulating:
        raise RuntimeError("ZeroOptimizer.set_gradient_accumulation_steps: an accumulation is under way (micro-"
                           "steps since the last boundary); change it after the boundary's step()")
    return steps


def refresh_master(buffers: Any) -> None:
    """The master copy of ``buffers`` (a `ZeroBuffers`) taken again from the model's parameters; nothing
    without one or at stage 3."""
    refuse_with_nvme(buffers.nvme, "refresh_fp32_params")
    if buffers.master is not None and not buffers.policy.shard_params:
        fill_master(buffers.master, buffers.params, buffers.layout, buffers.rank,
                    sharded=buffers.policy.shard_optimizer, dtype=buffers.dtype)


def empty_partition_cache(stage3: Any, frozen_stage3: Any) -> None:
    """Stage 3: every gathered parameter not persistent or in use released, and the pooled gather buffers."""
    if stage3 is not None:
        stage3.empty_cache()
        if frozen_stage3 is not None:
            frozen_stage3.empty_cache()
        gc.collect()
