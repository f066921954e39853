"""`ZeroOptimizer`: ZeRO stages 0-2 over a model and an optimizer class, in a plain training loop.

The model's trainable parameters become views of one flat buffer laid out by `FlatLayout` (buckets
in backward order, each split evenly into one shard per rank). As backward produces gradients
(post-accumulate-grad hooks), each complete bucket is reduced at once, asynchronously, so reduction
overlaps the rest of backward:

* stage 0: gradients accumulate in a flat buffer; at the accumulation boundary each bucket is
  multiplied by 1/world_size and all-reduced (DDP's arithmetic, so the result is DDP's bit for bit);
  the optimizer steps every element.
* stage 1: the same reduction; the optimizer steps only this rank's shard of each bucket (its states
  exist for that shard only), and the updated shards are all-gathered back into the parameters.
* stage 2: each micro-step, a complete bucket's gradients are copied into a reusable bucket buffer
  (times 1/world_size) and reduce-scattered into this rank's flat gradient partition; the full-size
  gradients are freed at once. Optimizer and gather as in stage 1.

The optimizer is the caller's class (``torch.optim.AdamW``, ``ds_ops.CPUAdam``, any optimizer whose
update is elementwise), built over one tensor per bucket: views of the flat buffer, so stepping them
updates the model.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import ds_comm

from ._layout import FlatLayout
from .config import BF16Config, FP16Config, ZeroConfig, mixed_precision

logger = logging.getLogger(__name__)

# Buckets hold at most this many elements, whatever reduce_bucket_size allows (DeepSpeed's default,
# 5e8, makes one bucket of a model below 500M parameters: its reduction cannot start before backward
# ends). 4M float32 elements (16 MiB, near DDP's 25 MiB buckets) overlap reduction with backward and
# keep stage 2's bucket buffers small; measured on the engine workload, see the README.
OVERLAP_BUCKET_ELEMENTS = 1 << 22

# Keys of zero_optimization this version accepts but cannot honour yet, and why.
_NOT_YET = {
    "zero_hpz_partition_size": (1, "ZeRO++ hierarchical partitioning"),
    "zero_quantized_weights": (False, "ZeRO++ quantized weights"),
    "zero_quantized_nontrainable_weights": (False, "ZeRO++ quantized weights"),
    "zero_quantized_gradients": (False, "ZeRO++ quantized gradients"),
    "mics_shard_size": (-1, "MiCS"),
    "legacy_stage1": (False, "DeepSpeed's legacy stage 1"),
}


class ZeroOptimizer:
    """ZeRO stages 0-2 for ``model`` with ``optimizer`` (a class or a callable taking the list of
    tensors to optimize), in a plain loop::

        zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={"lr": 1e-3},
                             config={"stage": 2, "reduce_bucket_size": 5e8})
        for batch in batches:
            zero.backward(loss_fn(model(batch)))
            zero.step()          # True when the optimizer stepped (at each accumulation boundary)
            zero.zero_grad()

    ``config``: the ``zero_optimization`` section (a `ZeroConfig`, a dict, or a whole DeepSpeed
    config). ``gradient_clipping``: the global gradient norm's maximum (0: off).
    ``gradient_accumulation_steps``: micro-steps per optimizer step; ``backward`` divides the loss by
    it, as DeepSpeed's engine does. ``group``: the data-parallel process group (default: all ranks).
    This version trains in float32; ``fp16``/``bf16`` sections that enable half precision are refused
    with a message until mixed precision lands.
    """

    def __init__(self, model: nn.Module, optimizer: type[torch.optim.Optimizer] | Callable = torch.optim.AdamW, *,
                 optimizer_kwargs: dict[str, Any] | None = None, config: Any = None, fp16: Any = None,
                 bf16: Any = None, gradient_clipping: float = 0.0, gradient_accumulation_steps: int = 1,
                 group: Any = None):
        if not isinstance(model, nn.Module):
            raise ValueError(f"ZeroOptimizer: model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(optimizer):
            raise ValueError(f"ZeroOptimizer: optimizer must be an optimizer class or a callable, got {optimizer!r}")
        self.config = ZeroConfig.from_section_or_ds_config(config)
        precision = mixed_precision(FP16Config.from_section_or_ds_config(fp16), BF16Config.from_section_or_ds_config(bf16))
        if precision != "fp32":
            raise NotImplementedError(f"ZeroOptimizer: {precision} training is not implemented yet in ds-zero "
                                      f"{_version()} (float32 only); disable {precision}.enabled")
        self._refuse_what_is_not_implemented()
        if isinstance(gradient_clipping, bool) or not isinstance(gradient_clipping, (int, float)) \
                or not math.isfinite(gradient_clipping) or gradient_clipping < 0:
            raise ValueError(f"gradient_clipping must be a number >= 0 (0: off), got {gradient_clipping!r}")
        if isinstance(gradient_accumulation_steps, bool) or not isinstance(gradient_accumulation_steps, int) \
                or gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be an integer >= 1, got {gradient_accumulation_steps!r}")
        if not ds_comm.is_initialized():
            raise RuntimeError("ZeroOptimizer: the process group is not initialised; call ds_comm.init_distributed() first")
        self.model, self.group = model, group
        self.stage = self.config.stage
        self.gradient_clipping = float(gradient_clipping)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.world_size, self.rank = ds_comm.get_world_size(group), ds_comm.get_rank(group)
        self._params = _trainable(model)
        _check_same_model(model, self._params, group, self.world_size)
        _broadcast_from_first_rank(model, group)

        bucket_size = min(self.config.reduce_bucket_size, OVERLAP_BUCKET_ELEMENTS)
        self.layout = FlatLayout([p.shape for p in self._params], world_size=self.world_size, bucket_size=bucket_size)
        self._flat = torch.zeros(self.layout.numel, dtype=torch.float32)
        for p, slot in zip(self._params, self.layout.slots, strict=True):
            if p.dtype != torch.float32:
                raise NotImplementedError(f"ZeroOptimizer: parameter {_name(model, p)} is {p.dtype}; this version "
                                          "trains float32 models only")
            view = self._flat[slot.offset:slot.offset + slot.numel].view(p.shape)
            view.copy_(p.detach())
            p.data = view
            p.grad = None
        self._bucket_of = {id(p): slot.bucket for p, slot in zip(self._params, self.layout.slots, strict=True)}
        self._owned = [self._shard(b) if self.stage > 0 else (b.offset, b.padded) for b in self.layout.buckets]
        if self.stage < 2:
            self._grads = torch.zeros(self.layout.numel, dtype=torch.float32)
            for p, slot in zip(self._params, self.layout.slots, strict=True):
                p.grad = self._grads[slot.offset:slot.offset + slot.numel].view(p.shape)
            step_grads = [self._grads[start:start + length] for start, length in self._owned]
        else:
            self._partition = torch.zeros(self.layout.shard_numel, dtype=torch.float32)
            offsets = self.layout.partition_offsets()
            step_grads = [self._partition[at:at + b.shard] for b, at in zip(self.layout.buckets, offsets, strict=True)]
            largest = max(b.padded for b in self.layout.buckets)
            # two bucket buffers (one fills while the other's reduce-scatter is in flight), one if
            # there is one bucket; reduce-scatters of later micro-steps of an accumulation land in a
            # received buffer first (the first micro-step's write the partition directly)
            count = min(2, len(self.layout.buckets))
            self._bucket_buffers = [torch.zeros(largest, dtype=torch.float32) for _ in range(count)]
            self._buffer_work: list[Any] = [None] * count
            self._next_buffer = 0
            shard = max(b.shard for b in self.layout.buckets) if gradient_accumulation_steps > 1 else 0
            self._received = [torch.zeros(shard, dtype=torch.float32) for _ in range(count)]
        self._pieces = self.layout.pieces(self.rank)  # for the gradient norm at stages 1-2
        self._shard_starts = self.layout.partition_offsets()
        self._step_params = []
        for (start, length), grad in zip(self._owned, step_grads, strict=True):
            tensor = nn.Parameter(self._flat[start:start + length], requires_grad=True)
            tensor.grad = grad
            self._step_params.append(tensor)
        self.optimizer = optimizer(self._step_params, **(optimizer_kwargs or {}))

        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._ready = [0] * len(self.layout.buckets)
        self._fired: set[int] = set()  # parameters whose gradient arrived in this backward
        self._reduced = [False] * len(self.layout.buckets)  # buckets reduced in this backward
        self._work: list[tuple[int, Any]] = []
        self._micro_step = 0
        self._callback_queued = False
        self._boundary_reduced = False  # the boundary's backward reduced every bucket
        self._global_grad_norm: float | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self._params]

    # ------------------------------------------------------------------------------------- loop API
    @property
    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step ends an accumulation (its ``step()`` updates the model)."""
        return (self._micro_step + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """``loss.backward()``, divided by ``gradient_accumulation_steps`` (``scale_wrt_gas``);
        gradients are reduced bucket by bucket as backward produces them."""
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError(f"ZeroOptimizer.backward: loss must be a one-element tensor, got "
                             f"{type(loss).__name__}{tuple(loss.shape) if torch.is_tensor(loss) else ''}")
        if scale_wrt_gas and self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        loss.backward(retain_graph=retain_graph)

    def step(self) -> bool:
        """At an accumulation boundary: wait for the reductions, clip, step, gather; returns True.
        Between boundaries: count the micro-step and return False."""
        boundary = self.is_gradient_accumulation_boundary
        self._micro_step += 1
        if not boundary:
            return False
        self._wait_reductions()
        norm = self._grad_norm()
        self._global_grad_norm = float(norm)
        if self.gradient_clipping > 0:  # torch.nn.utils.clip_grad_norm_'s arithmetic, in float32
            coefficient = (self.gradient_clipping / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_([t.grad for t in self._step_params], coefficient)
        self.optimizer.step()
        if self.stage > 0:
            self._gather_parameters()
        return True

    def zero_grad(self) -> None:
        """Zero the accumulated gradients (between boundaries this would drop micro-steps: it is a
        no-op there, as the accumulation needs them)."""
        if self._micro_step % self.gradient_accumulation_steps != 0:
            return
        if self.stage < 2:
            self._grads.zero_()
        else:
            self._partition.zero_()
            for p in self._params:
                p.grad = None

    def get_global_grad_norm(self) -> float | None:
        """The L2 norm of the whole (reduced, unclipped) gradient at the last step; None before one."""
        return self._global_grad_norm

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the model's states, by kind: ``params`` (the flat parameters),
        ``grads`` (full at stages 0-1, this rank's partition at stage 2), ``master`` (a separate
        float32 copy: none in float32 training, where the parameters are the master), ``optimizer``
        (the optimizer's state tensors), and ``buffers`` (stage 2's reusable bucket buffers)."""
        states = sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                     for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
        grads = self._grads if self.stage < 2 else self._partition
        buffers = [] if self.stage < 2 else [*self._bucket_buffers, *self._received]
        return {"params": self._flat.numel() * 4, "grads": grads.numel() * 4, "master": 0, "optimizer": states,
                "buffers": sum(b.numel() * 4 for b in buffers)}

    def state_dict(self) -> dict[str, Any]:
        """This rank's part: the optimizer's state over its shards, and what it was laid out for."""
        return {"zero_stage": self.stage, "world_size": self.world_size, "rank": self.rank,
                "shapes": [tuple(p.shape) for p in self._params], "bucket_size": self.layout.bucket_size,
                "micro_step": self._micro_step, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a `state_dict` saved by the same rank of the same layout (loading on another world
        size or stage is the checkpoint issue's reshaping)."""
        mine = {"zero_stage": self.stage, "world_size": self.world_size, "rank": self.rank,
                "shapes": [tuple(p.shape) for p in self._params], "bucket_size": self.layout.bucket_size}
        for key, value in mine.items():
            if key not in state:
                raise ValueError(f"ZeroOptimizer.load_state_dict: the state has no {key!r}")
            saved = [tuple(s) for s in state[key]] if key == "shapes" else state[key]
            if saved != value:
                raise ValueError(f"ZeroOptimizer.load_state_dict: saved with {key}={_short(saved)}, this optimizer "
                                 f"has {key}={_short(value)}")
        self.optimizer.load_state_dict(state["optimizer"])
        self._micro_step = int(state["micro_step"])

    # ------------------------------------------------------------------------------------ internals
    def _refuse_what_is_not_implemented(self) -> None:
        config = self.config
        if config.stage == 3:
            raise NotImplementedError("zero_optimization.stage 3 is not implemented yet in ds-zero "
                                      f"{_version()} (stages 0-2)")
        if config.offload_optimizer is not None and config.offload_optimizer.device != "none":
            raise NotImplementedError("zero_optimization.offload_optimizer is not implemented yet in ds-zero "
                                      f"{_version()}")
        for key, (default, what) in _NOT_YET.items():
            if getattr(config, key) != default:
                raise NotImplementedError(f"zero_optimization.{key} ({what}) is not implemented in ds-zero; "
                                          f"remove it or set it to {default!r}")
        if config.reduce_bucket_size == "auto":
            raise ValueError('zero_optimization.reduce_bucket_size is "auto": resolve it to a number of '
                             "elements first (the engine does this from the model)")

    def _shard(self, bucket) -> tuple[int, int]:
        return self.layout.shard_range(bucket, self.rank)

    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        index = self._index_of[id(param)]
        self._fired.add(index)
        b = self._bucket_of[id(param)]
        self._ready[b] += 1
        if self._ready[b] == len(self.layout.buckets[b].slots):
            self._reduce(b)

    def _after_backward(self) -> None:
        """End of a backward: buckets that still wait for a gradient are reduced now."""
        self._callback_queued = False
        if self._reduces_now():
            self._reduce_leftovers()
        self._ready = [0] * len(self.layout.buckets)
        self._fired.clear()
        self._reduced = [False] * len(self.layout.buckets)

    def _reduce_leftovers(self) -> None:
        """Reduce the buckets not reduced in this backward: their parameters without a gradient
        count as zero (``ignore_unused_parameters``) or are an error naming them."""
        left = [b for b in range(len(self.layout.buckets)) if not self._reduced[b]]
        if left and not self.config.ignore_unused_parameters:
            unused = sorted(i for b in left for i in self.layout.buckets[b].slots if i not in self._fired)
            names = ", ".join(_name(self.model, self._params[i]) for i in unused[:5])
            raise RuntimeError(f"ZeroOptimizer: no gradient in this backward for {names}"
                               f"{f' and {len(unused) - 5} more' if len(unused) > 5 else ''} "
                               "(zero_optimization.ignore_unused_parameters is false)")
        for b in left:
            self._reduce(b)
        if self.is_gradient_accumulation_boundary:
            self._boundary_reduced = True

    def _reduces_now(self) -> bool:
        return self.stage == 2 or self.is_gradient_accumulation_boundary

    def _reduce(self, b: int) -> None:
        if not self._reduces_now():
            return
        self._reduced[b] = True
        bucket = self.layout.buckets[b]
        scale = 1.0 / self.world_size
        if self.stage < 2:
            grads = self._grads[bucket.offset:bucket.offset + bucket.padded]
            grads.mul_(scale)  # DDP: bucket = grad * (1 / world_size), then a sum
            if self.stage == 0:
                work = ds_comm.all_reduce(grads, group=self.group, async_op=True)
            else:  # stage 1 needs only its shard: reduce-scatter in place (half all-reduce's traffic)
                work = ds_comm.reduce_scatter_bucket(grads, self._step_params[b].grad, group=self.group,
                                                     async_op=True)
            self._work.append((b, work))
            return
        which = self._next_buffer
        self._next_buffer = (which + 1) % len(self._bucket_buffers)
        if self._buffer_work[which] is not None:
            self._finish(*self._buffer_work[which])
            self._buffer_work[which] = None
        buffer = self._bucket_buffers[which][:bucket.padded]
        for index in bucket.slots:
            slot, param = self.layout.slots[index], self._params[index]
            target = buffer[slot.offset - bucket.offset:][:slot.numel]
            if param.grad is None or index not in self._fired:
                target.zero_()
            else:
                torch.mul(param.grad.reshape(-1), scale, out=target)  # DDP's mul_out into its bucket
            param.grad = None  # the full-size gradient is not needed any more
        if bucket.padded > bucket.numel:
            buffer[bucket.numel:].zero_()
        # The first micro-step of an accumulation writes the partition directly; later ones add.
        first = self._micro_step % self.gradient_accumulation_steps == 0
        output = self._step_params[b].grad if first else self._received[which][:bucket.shard]
        work = ds_comm.reduce_scatter_bucket(buffer, output, group=self.group, async_op=True)
        self._buffer_work[which] = (b, work, not first, which)

    def _finish(self, b: int, work: Any, add: bool, which: int) -> None:
        """Stage 2: wait for bucket ``b``'s reduce-scatter; add it to the partition if it did not
        write there directly."""
        work.wait()
        if add:
            self._step_params[b].grad.add_(self._received[which][:self.layout.buckets[b].shard])

    def _wait_reductions(self) -> None:
        if not self._boundary_reduced:  # a backward in which no hook ran (no parameter got a gradient)
            self._reduce_leftovers()
        self._boundary_reduced = False
        for _, work in self._work:
            work.wait()
        self._work.clear()
        if self.stage == 2:
            for which in range(len(self._buffer_work)):
                if self._buffer_work[which] is not None:
                    self._finish(*self._buffer_work[which])
                    self._buffer_work[which] = None

    def _grad_norm(self) -> torch.Tensor:
        """The global L2 norm as torch.nn.utils.clip_grad_norm_ computes it: the norm of the
        per-parameter norms. Stage 0 holds every reduced gradient, so this is local and bitwise
        torch's; at stages 1-2 each parameter's sum of squares is gathered from its pieces first."""
        if self.stage == 0:
            norms = torch._foreach_norm([p.grad for p in self._params])
            return torch.linalg.vector_norm(torch.stack(norms))
        squares = torch.zeros(len(self._params), dtype=torch.float32)
        for piece in self._pieces:
            shard = self._step_params[piece.bucket].grad
            part = shard[piece.partition_offset - self._shard_starts[piece.bucket]:][:piece.numel]
            squares[piece.index] += torch.dot(part, part)
        ds_comm.all_reduce(squares, group=self.group)
        return torch.linalg.vector_norm(squares.sqrt())

    def _gather_parameters(self) -> None:
        """Every rank's updated shards into every rank's parameters: one in-place all-gather per
        bucket (the rank's shard already sits in its place), all in flight at once."""
        works = [ds_comm.all_gather_bucket(self._flat[b.offset:b.offset + b.padded], group=self.group, async_op=True)
                 for b in self.layout.buckets]
        for work in works:
            work.wait()

def _version() -> str:
    from . import __version__

    return __version__


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    seen, params = set(), []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    if not params:
        raise ValueError("ZeroOptimizer: the model has no parameter that requires a gradient")
    return params


def _name(model: nn.Module, param: torch.Tensor) -> str:
    return next((name for name, p in model.named_parameters() if p is param), f"<parameter {tuple(param.shape)}>")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_same_model(model: nn.Module, params: list[nn.Parameter], group: Any, world_size: int) -> None:
    """Every rank must lay out the same parameters: compare a fingerprint of their names, shapes and
    dtypes (one small all-gather) and name the first difference on every rank, instead of hanging in
    a collective of mismatched sizes later."""
    names = {id(p): name for name, p in model.named_parameters()}
    described = [(names.get(id(p), "?"), tuple(p.shape), str(p.dtype)) for p in params]
    digest = hashlib.sha256(repr(described).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    everyone = torch.zeros(world_size, dtype=torch.int64)
    ds_comm.all_gather_into_tensor(everyone, mine, group=group)
    if bool((everyone == everyone[0]).all()):
        return
    lists: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(lists, described, group=group)
    for rank, other in enumerate(lists):
        if other != lists[0]:
            first = next((i for i, (a, b) in enumerate(zip(lists[0], other, strict=False)) if a != b),
                         min(len(lists[0]), len(other)))
            theirs = other[first] if first < len(other) else "nothing"
            ours = lists[0][first] if first < len(lists[0]) else "nothing"
            raise ValueError(f"ZeroOptimizer: the ranks' models differ: parameter {first} is {ours} on rank 0 "
                             f"and {theirs} on rank {rank} ({len(lists[0])} vs {len(other)} trainable parameters)")


def _broadcast_from_first_rank(model: nn.Module, group: Any) -> None:
    """Start from rank 0's parameters and buffers, as DDP does."""
    source = ds_comm.get_global_rank(group, 0) if group is not None else 0
    for tensor in [*model.parameters(), *model.buffers()]:
        ds_comm.broadcast(tensor.data, src=source, group=group)
