"""Activation checkpointing (DeepSpeed's ``deepspeed.checkpointing``): keep a function's inputs, not
its activations, and run it again in backward.

    ds_all.checkpointing.configure(mpu, deepspeed_config=config)      # the activation_checkpointing section
    hidden = ds_all.checkpointing.checkpoint(block, hidden, mask)

What the section asks for, each real:

* ``partition_activations``: each model-parallel rank keeps only its slice of every saved input
  (the inputs of a tensor-parallel block are the same on all of them); backward all-gathers them.
  Without an ``mpu`` there is one model-parallel rank and nothing to split.
* ``cpu_checkpointing``: saved inputs are kept in CPU memory (a copy when they live on a device).
* ``contiguous_memory_optimization``: saved inputs are copied into one buffer per checkpoint
  position, reused step after step (``number_checkpoints`` positions; needs partition_activations,
  as DeepSpeed's).
* ``synchronize_checkpoint_boundary``: the device is synchronised before and after each checkpoint.
* ``profile``: the forward and the recompute of each checkpoint are timed (``profile_times()``).

The random state (CPU, CUDA, and the model-parallel tracker's) is saved at the forward and restored
for the recompute, so dropout draws the same mask: gradients equal those of the plain function.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

import ds_comm
import ds_ops
from ds_parallel import CudaRNGStatesTracker, get_cuda_rng_tracker  # noqa: F401 (DeepSpeed exports the class here)
from ds_parallel import model_parallel_cuda_manual_seed as _seed_model_parallel

from ._monitor_config import ActivationCheckpointingConfig

# One tracker per process, ds-parallel's (its tensor-parallel layers draw dropout from it): the
# names below are DeepSpeed's deepspeed.checkpointing ones.
_tracker = get_cuda_rng_tracker()


def _device_rng() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _get_rng() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _device_rng() else torch.get_rng_state()


def _set_rng(state: torch.Tensor) -> None:
    (torch.cuda.set_rng_state if _device_rng() else torch.set_rng_state)(state)


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Megatron's seeding: the default generator gets ``seed`` (the same on every model-parallel
    rank, for data-parallel-like regions) and the tracker's model-parallel state ``seed + 2718 +
    model-parallel rank`` (different per rank, for tensor-parallel dropout)."""
    rank = _mpu.get_model_parallel_rank() if _mpu is not None else 0
    _seed_model_parallel(seed, rank=rank)


# ------------------------------------------------------------------------------------- settings
_mpu: Any = None
_settings = ActivationCheckpointingConfig()
_configured = False
_buffers: dict[tuple[int, int], torch.Tensor] = {}  # contiguous_memory_optimization: (position, input) -> buffer
_in_use: set[tuple[int, int]] = set()  # positions whose buffer holds inputs a backward has not read yet
_position = 0  # the index of the next checkpoint in this forward
_times: list[tuple[float, float]] = []  # profile: (forward s, recompute s) per checkpoint call


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """Set what `checkpoint` does: from ``deepspeed_config`` (a DeepSpeed config, or its
    ``activation_checkpointing`` section), then the keyword overrides. ``mpu_`` gives the
    model-parallel group (``get_model_parallel_group/rank/world_size``) that partitioning splits over."""
    global _mpu, _settings, _configured
    section = ActivationCheckpointingConfig.from_section_or_ds_config(
        getattr(deepspeed_config, "activation_checkpointing", deepspeed_config))
    overrides = {"partition_activations": partition_activations, "contiguous_memory_optimization":
                 contiguous_checkpointing, "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
                 "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    settings = section.model_copy(update={k: v for k, v in overrides.items() if v is not None})
    settings = ActivationCheckpointingConfig.model_validate(settings.model_dump())
    if settings.contiguous_memory_optimization:
        if not settings.partition_activations:
            raise ValueError("activation_checkpointing.contiguous_memory_optimization needs partition_activations "
                             "(the contiguous buffers hold partitions)")
        if settings.number_checkpoints is None:
            raise ValueError("activation_checkpointing.contiguous_memory_optimization needs number_checkpoints "
                             "(the checkpoints per forward, one buffer each)")
    _mpu, _settings, _configured = mpu_, settings, True
    reset()


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """Forget the contiguous buffers and profile times (DeepSpeed calls it between iterations)."""
    global _position
    _buffers.clear()
    _in_use.clear()
    _times.clear()
    _position = 0


def profile_times() -> list[tuple[float, float]]:
    """``(forward seconds, recompute seconds)`` of each checkpoint call since `reset` (``profile``)."""
    return list(_times)


def _mp_group() -> tuple[Any, int, int]:
    """The model-parallel group, rank and size; without an mpu there is no model parallelism (size 1:
    partitioning keeps everything, as DeepSpeed's does)."""
    if _mpu is None:
        return None, 0, 1
    return _mpu.get_model_parallel_group(), _mpu.get_model_parallel_rank(), _mpu.get_model_parallel_world_size()


def _synchronize() -> None:
    if _settings.synchronize_checkpoint_boundary:
        ds_ops.get_accelerator().synchronize()  # the device's work done (nothing to wait for on the CPU)


# ------------------------------------------------------------------------------------- storing
def _store(tensor: torch.Tensor, slot: tuple[int, int]) -> tuple[torch.Tensor, dict[str, Any]]:
    """What is kept of one saved input, and how to rebuild it."""
    meta = {"shape": tensor.shape, "dtype": tensor.dtype, "device": tensor.device,
            "requires_grad": tensor.requires_grad, "partitioned": False}
    kept = tensor.detach()
    if _settings.partition_activations and tensor.numel() > 1:
        _, rank, world = _mp_group()
        if world > 1:
            flat = kept.reshape(-1)
            size = -(-flat.numel() // world)
            padded = torch.nn.functional.pad(flat, (0, size * world - flat.numel()))
            kept = padded[rank * size:(rank + 1) * size].clone()
            meta.update(partitioned=True, size=size, world=world)
    if _settings.contiguous_memory_optimization:
        buffer = _buffers.get(slot)
        if buffer is not None and slot in _in_use:
            raise RuntimeError(f"checkpoint: more checkpoints are waiting for backward than "
                               f"activation_checkpointing.number_checkpoints={_settings.number_checkpoints}; "
                               "raise it to the number of checkpoint calls per forward")
        if buffer is None or buffer.numel() != kept.numel() or buffer.dtype != kept.dtype:
            buffer = _buffers[slot] = torch.empty(kept.numel(), dtype=kept.dtype, device=kept.device)
        buffer.copy_(kept.reshape(-1))
        _in_use.add(slot)
        meta["slot"] = slot
        kept = buffer
    if _settings.cpu_checkpointing and kept.device.type != "cpu":
        kept = kept.to("cpu")
    return kept, meta


def _restore(kept: torch.Tensor, meta: dict[str, Any]) -> torch.Tensor:
    tensor = kept.to(meta["device"])
    if "slot" in meta:
        tensor = tensor.clone()  # the buffer is free for the next forward's checkpoint at this position
        _in_use.discard(meta["slot"])
    if meta["partitioned"]:
        group, _, world = _mp_group()
        gathered = torch.empty(meta["size"] * world, dtype=tensor.dtype, device=tensor.device)
        ds_comm.all_gather_into_tensor(gathered, tensor.reshape(-1).contiguous(), group=group)
        tensor = gathered[:meta["shape"].numel()]
    tensor = tensor.reshape(meta["shape"]).detach()
    return tensor.requires_grad_(meta["requires_grad"])


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, _needs_grad, *args):
        global _position
        ctx.run_function = run_function
        ctx.rng = (_get_rng(), _tracker.get_states())
        slot, _position = _position, _position + 1
        if _settings.number_checkpoints is not None and _position >= _settings.number_checkpoints:
            _position = 0
        _synchronize()
        begin = time.perf_counter()
        with torch.no_grad():
            outputs = run_function(*args)
        _synchronize()
        ctx.forward_s = time.perf_counter() - begin
        ctx.args = [None if torch.is_tensor(a) else a for a in args]
        stored = [_store(a, (slot, i)) for i, a in enumerate(a for a in args if torch.is_tensor(a))]
        ctx.metas = [meta for _, meta in stored]
        ctx.save_for_backward(*[kept for kept, _ in stored])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        tensors = iter(_restore(kept, meta) for kept, meta in zip(ctx.saved_tensors, ctx.metas, strict=True))
        inputs = [next(tensors) if a is None else a for a in ctx.args]
        outside = (_get_rng(), _tracker.get_states())
        _set_rng(ctx.rng[0])
        _tracker.set_states(ctx.rng[1])
        _synchronize()
        begin = time.perf_counter()
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*inputs)
        finally:
            _set_rng(outside[0])
            _tracker.set_states(outside[1])
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        _synchronize()
        if _settings.profile:
            _times.append((ctx.forward_s, time.perf_counter() - begin))
        return (None, None, *[a.grad if torch.is_tensor(a) and a.requires_grad else None for a in inputs])


def checkpoint(function: Callable, *args: Any) -> Any:
    """``function(*args)``, keeping only ``args`` (as `configure` says) and recomputing the rest in
    backward. Positional arguments only, as DeepSpeed's; returns what ``function`` returns."""
    if not callable(function):
        raise ValueError(f"checkpoint: function must be callable, got {type(function).__name__}")
    # An input that requires grad, always: the output then has a backward even when no argument needs
    # a gradient (the first layer's inputs), so the recompute still gives the parameters inside theirs.
    needs_grad = torch.empty(0, requires_grad=torch.is_grad_enabled())
    return _CheckpointFunction.apply(function, needs_grad, *args)
