"""`GradientReducer`: the gradient reduction of a `ZeroOptimizer`, a part with its own state. It owns the
bucket (staging) and received buffers, the post-accumulate-grad hook that reduces a bucket as soon as its
gradients are complete (all-reduce without sharded optimizer states, reduce-scatter with them: `_collectives`),
the reductions in flight and their waiting. Its inputs are explicit: the layout and policy, the parameters,
where each bucket's reduced gradients land, the gradient slots, and a callable saying whether the current
micro-step ends an accumulation."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._collectives import start_bucket_reduction
from ._grad_slots import GradientSlots
from ._model import param_name
from ._stage3_guard import REDUCTION
from ._zeropp import QuantizedReduction

logger = logging.getLogger("ds_zero._optimizer")


class GradientReducer:
    """See the module docstring. ``owner``: the optimizer whose backward marks itself running (`GradientSlots`);
    ``grads``: the flat gradients of stages 0-1 (None at 2-3); ``shard_grads``: per bucket, where this rank's
    reduced gradients land; ``groups``: per bucket, the group it is reduced over; ``is_boundary``: whether the
    current micro-step ends an accumulation; ``stage3``: the `Stage3`s whose backward events follow the
    reductions (the trained one first, then the frozen one; None where absent); ``host``: ZeRO-Offload's
    buffers, which each landed reduction is copied into at a boundary."""

    def __init__(self, *, owner: object, model: Any, layout: Any, policy: Any, params: Sequence[torch.Tensor],
                 grads: torch.Tensor | None, shard_grads: Sequence[torch.Tensor], slots: GradientSlots,
                 groups: Sequence[Any], averaging_size: int, accumulation_steps: int, device: torch.device,
                 ignore_unused: bool, is_boundary: Callable[[], bool], trained_stage3: Any, frozen_stage3: Any,
                 host: Any):
        self.owner, self.model, self.layout, self.policy, self.params = owner, model, layout, policy, params
        self.grads, self.shard_grads, self.slots, self.groups = grads, shard_grads, slots, groups
        self.scale = 1.0 / averaging_size  # DDP's arithmetic; the data-parallel size with sequence parallelism
        self.device, self.ignore_unused, self.is_boundary = device, ignore_unused, is_boundary
        self.index_of = {id(p): i for i, p in enumerate(params)}
        self.bucket_of = {id(p): slot.bucket for p, slot in zip(params, layout.slots, strict=True)}
        self.trained_stage3, self.frozen_stage3, self.host = trained_stage3, frozen_stage3, host
        # stage 2 reduces from bucket buffers (two: one fills while the other's reduce-scatter is in flight, one if
        # there is one bucket); stages 0-1 need them only to reduce in another dtype (bf16 gradients summed in
        # float32). Received buffers take a reduce-scatter's output when it cannot land in the gradient partition
        # directly (accumulation, another dtype).
        buckets, comm, dtype = layout.buckets, policy.communication_dtype, policy.dtype
        staged = policy.shard_optimizer or comm != dtype  # stage 1: the local accumulation stays in .grad
        count = min(2, len(buckets)) if staged else 0
        self.bucket_buffers = [torch.zeros(max(b.padded for b in buckets), dtype=comm, device=device)
                               for _ in range(count)]
        self.buffer_work: list[Any] = [None] * count
        self._next_buffer = 0
        received = staged and policy.shard_optimizer and (comm != dtype or accumulation_steps > 1)
        shard = max(b.shard for b in buckets) if received else 0
        self.received = [torch.zeros(shard, dtype=comm, device=device) for _ in range(count)] if received else []
        self.ready = [0] * len(buckets)
        self.fired: set[int] = set()  # parameters whose gradient arrived in this backward
        self.reduced = [False] * len(buckets)  # buckets reduced in this backward
        self.work: list[tuple[Any, Callable | None]] = []  # reductions in flight without a staging buffer
        self.accumulated = False  # a backward since the last boundary's step (stages 2-3: in the partition)
        self.boundary_reduced = False  # the boundary's backward reduced every bucket
        self.average_now = True  # whether this accumulation's gradients are averaged (a 1-bit optimizer decides)
        self.wait_s = 0.0  # seconds spent waiting for reductions (the engine's "allreduce" timer)
        self._callback_queued = False
        self._foreign_pass = False  # the backward now running is another optimizer's (stages 2-3: held)
        # stage 3 with qgZ: the reduce-scatter is ZeRO++'s quantized hierarchical one (`_zeropp`)
        self.quantized = QuantizedReduction(groups[0]) if trained_stage3 is not None and \
            policy.zeropp.quantized_gradients else None

    # ------------------------------------------------------------------------------ during backward
    def on_gradient(self, param: torch.Tensor) -> None:
        """The post-accumulate-grad hook of every trained parameter."""
        if not self._callback_queued:
            self._callback_queued = True
            # stages 2-3 cannot take a reduced gradient back when the user clears .grad (`_grad_slots`): what
            # another optimizer's backward makes here waits in .grad (stages 0-1 reduce it, as DDP does)
            self._foreign_pass = self.policy.shard_grads and GradientSlots.foreign(self.owner)
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        index = self.index_of[id(param)]
        if self._foreign_pass:
            self.slots.hold(index)
            return
        if self.policy.whole_grads:
            self.slots.adopt(index)  # into ZeRO's buffer, wherever autograd put it
        else:
            self.slots.reduced(index)  # (reduced with its bucket, held or not)
        self.fired.add(index)
        b = self.bucket_of[id(param)]
        self.ready[b] += 1
        if self.ready[b] == len(self.layout.buckets[b].slots):
            self.reduce(b)

    def _after_backward(self) -> None:
        """End of a backward: buckets that still wait for a gradient are reduced now."""
        self._callback_queued = False
        foreign, self._foreign_pass = self._foreign_pass, False
        if self._reduces_now() and not foreign:
            self._reduce_leftovers()
            if self.policy.whole_grads and self.is_boundary():
                # .grad holds the averaged gradients when backward returns (stage 0), as with DDP, and the next
                # backward may accumulate into the buffer: nothing of it stays in flight
                waited = time.perf_counter()
                self.finish_in_flight()
                self.wait_s += time.perf_counter() - waited
                self.slots.boundary_landed()
        for stage3 in (self.trained_stage3, self.frozen_stage3):  # (frozen: its units gathered in this backward)
            if stage3 is not None:
                stage3.after_backward()
        if not foreign:
            self.accumulated = True  # stages 2-3: the next backward's reductions add to this one's
        self._clear()

    def _clear(self) -> None:
        self.ready = [0] * len(self.layout.buckets)
        self.fired.clear()
        self.reduced = [False] * len(self.layout.buckets)

    def _reduce_leftovers(self) -> None:
        """Reduce the buckets not reduced in this backward: their parameters without a gradient
        count as zero (``ignore_unused_parameters``) or are an error naming them."""
        left = [b for b in range(len(self.layout.buckets)) if not self.reduced[b]]
        if left and not self.ignore_unused:
            unused = sorted(i for b in left for i in self.layout.buckets[b].slots if i not in self.fired)
            names = ", ".join(param_name(self.model, self.params[i]) for i in unused[:5])
            raise RuntimeError(f"ZeroOptimizer: no gradient in this backward for {names}"
                               f"{f' and {len(unused) - 5} more' if len(unused) > 5 else ''} "
                               "(zero_optimization.ignore_unused_parameters is false)")
        for b in left:
            self.reduce(b)
        if self.is_boundary():
            self.boundary_reduced = True

    def _reduces_now(self) -> bool:
        return (self.policy.shard_grads or self.is_boundary()) and self.average_now

    def reduce(self, b: int) -> None:
        """Start bucket ``b``'s reduction: gradients × 1/world_size (DDP's arithmetic; 1/gradient_averaging_size
        when given), summed by an all-reduce (stage 0) or a reduce-scatter into this rank's shard (stages 1-2).
        In place at stages 0-1 when the reduction dtype is the gradients'; else through a staging buffer."""
        if not self._reduces_now():
            return
        self.reduced[b] = True
        bucket, group = self.layout.buckets[b], self.groups[b]  # ZeRO's group, or the bucket's replicas'
        mine = self.shard_grads[b]  # this rank's reduced gradients of the bucket end up here
        if self.policy.whole_grads:
            self.slots.sync(bucket.slots)  # every .grad in the buffer (a replaced one copied, a cleared one zero)
            grads = self.grads[bucket.offset:bucket.offset + bucket.padded]
            if not self.bucket_buffers:  # stage 0: all-reduced in place, DDP's arithmetic
                grads.mul_(self.scale)
                self.work.append((start_bucket_reduction(grads, None, group=group), self._landed(b, None)))
                return
            which, buffer = self._staging_buffer(bucket.padded)
            torch.mul(grads, self.scale, out=buffer)
        else:
            which, buffer = self._staging_buffer(bucket.padded)
            for index in bucket.slots:
                slot, param = self.layout.slots[index], self.params[index]
                target = buffer[slot.offset - bucket.offset:][:slot.numel]
                if param.grad is None:  # (a .grad held from another optimizer's backward counts: `_grad_slots`)
                    target.zero_()
                else:
                    torch.mul(param.grad.reshape(-1), self.scale, out=target)  # DDP's mul_out into its bucket
                param.grad = None  # the full-size gradient is not needed any more
                self.slots.reduced(index)
            if bucket.padded > bucket.numel:
                buffer[bucket.numel:].zero_()
            if self.trained_stage3 is not None:  # backward is done with this unit's parameters
                self.trained_stage3.after_reduction(b)
        if not self.policy.shard_optimizer:
            work = self._start(b, buffer, None, group)
            self.buffer_work[which] = (work, self._landed(b, lambda: grads.copy_(buffer)))
            return
        # The first micro-step of an accumulation writes the shard directly when the dtypes agree;
        # otherwise the reduce-scatter lands in a received buffer, then is copied or added. Stage 1 reduces
        # the whole local accumulation each time (.grad keeps it): its result replaces the shard's.
        first = self.policy.reduces_whole_accumulation or not self.accumulated
        if first and mine.dtype == buffer.dtype:
            work = self._start(b, buffer, mine, group)
            self.buffer_work[which] = (work, self._landed(b, None))
            return
        received = self._received_buffers()[which][:bucket.shard]
        work = self._start(b, buffer, received, group)
        self.buffer_work[which] = (work, self._landed(b, (lambda: mine.copy_(received)) if first else
                                                      (lambda: mine.add_(received))))

    def _start(self, b: int, buffer: torch.Tensor, out: torch.Tensor | None, group: Any) -> Any:
        """Start bucket ``b``'s reduction; at stage 3 as a collective of the path guard's log (`Stage3.reduce`)."""
        if self.trained_stage3 is None:
            return start_bucket_reduction(buffer, out, group=group)

        reduce = self.quantized or (lambda source, into: start_bucket_reduction(source, into, group=group))

        def start(scratch: bool) -> Any:  # (stage 3: ``out`` is this rank's shard)
            if scratch:
                return reduce(torch.zeros_like(buffer, device=buffer.device), torch.empty_like(out, device=out.device))
            return reduce(buffer, out)

        guard = self.trained_stage3.guard  # a collective of its log; its wait watches the path (`PathGuard`)
        guard.issuing(REDUCTION - b, lambda: start(True))
        return guard.issued(start(False))

    def _landed(self, b: int, then: Callable | None) -> Callable | None:
        """What runs once bucket ``b``'s reduction has landed: ``then``, and under ZeRO-Offload at the
        accumulation boundary, the copy of this rank's reduced shard to the host (`_offload`)."""
        if self.host is None or not self.is_boundary():
            return then
        host = self.host

        def landed() -> None:
            if then is not None:
                then()
            host.download(b)

        return landed

    def _received_buffers(self) -> list[torch.Tensor]:
        """The received buffers, made on first use where the constructor saw no need for them (an
        accumulation decided by hand: set_gradient_accumulation_boundary or _steps)."""
        if not self.received:
            shard = max(b.shard for b in self.layout.buckets)
            self.received = [torch.zeros(shard, dtype=self.policy.communication_dtype, device=self.device)
                             for _ in self.bucket_buffers]
        return self.received

    def _staging_buffer(self, length: int) -> tuple[int, torch.Tensor]:
        """The next bucket buffer (waiting for the reduction that still uses it, if any)."""
        which = self._next_buffer
        self._next_buffer = (which + 1) % len(self.bucket_buffers)
        if self.buffer_work[which] is not None:  # (in backward: a stage-3 wait also watches the path)
            guard = None if self.trained_stage3 is None else self.trained_stage3.guard
            _complete(*self.buffer_work[which], waiting=guard)
            self.buffer_work[which] = None
        return which, self.bucket_buffers[which][:length]

    # ------------------------------------------------------------------------------ at the step
    def wait_for_step(self) -> None:
        """At a boundary's step: reduce what is still to reduce (gradients held from another optimizer's
        backward, a backward in which no hook ran), then wait for every reduction."""
        held = self.slots.take_held() if self.policy.shard_grads and self.average_now else []
        if held:  # gradients another optimizer's backward made and the user kept: reduced now (`_grad_slots`)
            self.fired = set(held)
            for b in sorted({self.bucket_of[id(self.params[i])] for i in held}):
                self.reduce(b)
        if not self.boundary_reduced and self.average_now:  # a backward in which no hook ran
            self._reduce_leftovers()
        if held:
            self.accumulated = True
            self._clear()
        self.boundary_reduced = False
        self.finish_in_flight()

    def reduce_all(self) -> None:
        """Start the reduction of every bucket from the gradients in ``.grad`` (a caller that reduces by hand:
        its backward passes are done). A parameter without a gradient counts as zeros."""
        self.fired = {i for i, p in enumerate(self.params) if p.grad is not None}
        for b in range(len(self.layout.buckets)):
            self.reduce(b)
        self.boundary_reduced = True
        self.accumulated = True
        self._clear()

    def finish_in_flight(self) -> None:
        """Complete every reduction issued and not yet waited for."""
        for pending in self.work:
            _complete(*pending)
        self.work.clear()
        for which, pending in enumerate(self.buffer_work):
            if pending is not None:
                _complete(*pending)
                self.buffer_work[which] = None

    def close(self) -> None:
        """Complete reductions still in flight (a close between backward and step), so no collective is left
        half-issued on this rank, and free the buffers."""
        try:
            for pending in [*self.work, *(w for w in self.buffer_work if w is not None)]:
                _complete(*pending)
        except Exception as e:  # the group may be gone already; nothing to finish then
            logger.debug("ZeroOptimizer.close: pending reductions not completed (%s)", e)
        self.work, self.buffer_work = [], []
        self.bucket_buffers, self.received = [], []
        self.host = None
        if self.quantized is not None:
            self.quantized.close()


def _complete(work: Any, then: Callable | None, waiting: Any = None) -> None:
    if waiting is None:
        work.wait()
    else:
        waiting.wait(work)
    if then is not None:
        then()
