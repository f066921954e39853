"""What `ZeroOptimizer` holds, saved and restored: the bytes held by kind, and a rank's own
``state_dict()``/``load_state_dict()`` (same rank, same layout; other world sizes and stages go through
`_checkpoint`). Plain functions over explicit arguments: the optimizer's `ZeroBuffers`, its torch
optimizer, its loss scaler; `ZeroOptimizer` calls them and keeps the counters they return."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._buffers import ZeroBuffers
from ._filling import refuse_with_nvme
from ._model import short


def memory_bytes(buffers: ZeroBuffers, optimizer: torch.optim.Optimizer,
                 reduction_buffers: Iterable[torch.Tensor]) -> dict[str, int]:
    """See `ZeroOptimizer.memory_bytes`; ``reduction_buffers``: the `GradientReducer`'s bucket and receive buffers."""
    def size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t) and t.dim() > 0)

    stage3, frozen, nvme = buffers.stage3, buffers.frozen, buffers.nvme
    grads = [buffers.grads, buffers.partition, buffers.master_grads]
    gathered = stage3.held_bytes() if stage3 is not None else 0  # stage 3: whole units now
    partition = buffers.flat.untyped_storage().nbytes()  # 0 when the parameters are on NVMe
    partition += frozen.nbytes() if frozen is not None else 0  # stage 3's frozen parameters
    out = {"params": partition + gathered, "grads": size(grads), "master": size([buffers.master]),
           "optimizer": size(t for state in optimizer.state.values() for t in state.values()),
           "buffers": size(reduction_buffers) + (stage3.pooled_bytes() if stage3 is not None else 0)}
    if nvme is not None:  # RAM: its chunk buffers; the states and master copy are on disk
        out["optimizer"] += nvme.memory_bytes()
        out["nvme"] = nvme.offloaded_bytes
    return out


def identity(*, stage: int, world_size: int, rank: int, precision: str, layout: Any) -> dict[str, Any]:
    """What a rank's state was laid out for (a load checks it matches)."""
    return {"zero_stage": stage, "world_size": world_size, "rank": rank, "precision": precision,
            "shapes": [tuple(s.shape) for s in layout.slots], "bucket_size": layout.bucket_size}


def rank_state(ident: dict[str, Any], buffers: ZeroBuffers, optimizer: torch.optim.Optimizer, scaler: Any, *,
               micro_step: int, skipped_steps: int) -> dict[str, Any]:
    """See `ZeroOptimizer.state_dict`."""
    refuse_with_nvme(buffers.nvme, "state_dict")
    state = {**ident, "micro_step": micro_step, "optimizer": optimizer.state_dict(), "skipped_steps": skipped_steps}
    if buffers.policy.shard_params:
        state["partition"] = buffers.flat.clone()
    if buffers.master is not None:
        state["master"] = buffers.master.clone()
    if scaler is not None:
        state["loss_scaler"] = scaler.state_dict()
    return state


def load_rank_state(state: dict[str, Any], ident: dict[str, Any], buffers: ZeroBuffers,
                    optimizer: torch.optim.Optimizer, scaler: Any, *, optimizer_loaded: Callable[[], None],
                    set_counters: Callable[[int, int], None]) -> None:
    """See `ZeroOptimizer.load_state_dict`: the state checked against ``ident`` and loaded into ``optimizer``
    (then ``optimizer_loaded()``), ``buffers`` and ``scaler``; the saved micro-step and skipped steps go to
    ``set_counters``. The caller refreshes the parameters (a collective) when `needs_refresh`."""
    refuse_with_nvme(buffers.nvme, "load_state_dict")
    for key, value in ident.items():
        if key not in state:
            raise ValueError(f"ZeroOptimizer.load_state_dict: the state has no {key!r}")
        saved = [tuple(s) for s in state[key]] if key == "shapes" else state[key]
        if saved != value:
            raise ValueError(f"ZeroOptimizer.load_state_dict: saved with {key}={short(saved)}, this optimizer "
                             f"has {key}={short(value)}")
    optimizer.load_state_dict(state["optimizer"])
    optimizer_loaded()
    if buffers.policy.shard_params:
        buffers.flat.copy_(state["partition"])
    set_counters(int(state["micro_step"]), int(state.get("skipped_steps", 0)))
    if scaler is not None:
        scaler.load_state_dict(state["loss_scaler"])
    if buffers.master is not None:
        buffers.master.copy_(state["master"])
        for copy, tensor in zip(buffers.copies, buffers.step_params, strict=True):
            copy.copy_(tensor.detach())


def needs_refresh(buffers: ZeroBuffers) -> bool:
    """After a load: whether the parameters follow from what was loaded (a master copy, stage 3's shards)."""
    return buffers.master is not None or buffers.policy.shard_params
