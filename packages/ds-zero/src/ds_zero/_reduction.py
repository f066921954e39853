"""Gradient reduction of `ZeroOptimizer`: bucket buffers, the post-accumulate-grad hooks that reduce a
bucket as soon as its gradients are complete (all-reduce at stage 0, reduce-scatter from stage 1),
waiting for the reductions, the global gradient norm, and the hookup of a 1-bit optimizer (which decides
per step whether the gradients are averaged). A mixin: `ZeroOptimizer` owns the state."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

import ds_comm

from ._model import param_name

logger = logging.getLogger("ds_zero._optimizer")


class Reduction:
    """The reduction half of `ZeroOptimizer` (see the module docstring)."""

    def _make_reduction_buffers(self) -> None:
        """Stage 2 reduces from bucket buffers (two: one fills while the other's reduce-scatter is in
        flight, one if there is one bucket); stages 0-1 need them only to reduce in another dtype
        (bf16 gradients summed in float32). Received buffers take a reduce-scatter's output when it
        cannot land in the gradient partition directly (accumulation, another dtype)."""
        buckets, comm = self.layout.buckets, self.communication_data_type
        staged = self.policy.shard_optimizer or comm != self.dtype  # stage 1: the local accumulation stays in .grad
        count = min(2, len(buckets)) if staged else 0
        self._bucket_buffers = [torch.zeros(max(b.padded for b in buckets), dtype=comm, device=self.device)
                                for _ in range(count)]
        self._buffer_work: list[Any] = [None] * count
        self._next_buffer = 0
        received = staged and self.policy.shard_optimizer and (comm != self.dtype or self.gradient_accumulation_steps > 1)
        shard = max(b.shard for b in buckets) if received else 0
        self._received = [torch.zeros(shard, dtype=comm, device=self.device) for _ in range(count)] if received else []

    def _shard(self, bucket) -> tuple[int, int]:
        return self.layout.shard_range(bucket, self.rank)

    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            # stages 2-3 cannot take a reduced gradient back when the user clears .grad (`_grad_slots`): what
            # another optimizer's backward makes here waits in .grad (stages 0-1 reduce it, as DDP does)
            self._foreign_pass = self.policy.shard_grads and self._slots.foreign(self)
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        index = self._index_of[id(param)]
        if self._foreign_pass:
            self._slots.hold(index)
            return
        if self.policy.whole_grads:
            self._slots.adopt(index)  # into ZeRO's buffer, wherever autograd put it
        else:
            self._slots.reduced(index)  # (reduced with its bucket, held or not)
        self._fired.add(index)
        b = self._bucket_of[id(param)]
        self._ready[b] += 1
        if self._ready[b] == len(self.layout.buckets[b].slots):
            self._reduce(b)

    def _after_backward(self) -> None:
        """End of a backward: buckets that still wait for a gradient are reduced now."""
        self._callback_queued = False
        foreign, self._foreign_pass = self._foreign_pass, False
        if self._reduces_now() and not foreign:
            self._reduce_leftovers()
            if self.policy.whole_grads and self.is_gradient_accumulation_boundary:
                # .grad holds the averaged gradients when backward returns (stage 0), as with DDP, and the next
                # backward may accumulate into the buffer: nothing of it stays in flight
                waited = time.perf_counter()
                self._finish_in_flight()
                self.reduction_wait_s += time.perf_counter() - waited
                self._slots.boundary_landed()
        if self._stage3 is not None:
            self._stage3.after_backward()
        if self._frozen is not None:  # stage 3's frozen units gathered in this backward
            self._frozen.stage3.after_backward()
        if not foreign:
            self._accumulated = True  # stages 2-3: the next backward's reductions add to this one's
        self._ready = [0] * len(self.layout.buckets)
        self._fired.clear()
        self._reduced = [False] * len(self.layout.buckets)

    def _reduce_leftovers(self) -> None:
        """Reduce the buckets not reduced in this backward: their parameters without a gradient
        count as zero (``ignore_unused_parameters``) or are an error naming them."""
        left = [b for b in range(len(self.layout.buckets)) if not self._reduced[b]]
        if left and not self.config.ignore_unused_parameters:
            unused = sorted(i for b in left for i in self.layout.buckets[b].slots if i not in self._fired)
            names = ", ".join(param_name(self.model, self._params[i]) for i in unused[:5])
            raise RuntimeError(f"ZeroOptimizer: no gradient in this backward for {names}"
                               f"{f' and {len(unused) - 5} more' if len(unused) > 5 else ''} "
                               "(zero_optimization.ignore_unused_parameters is false)")
        for b in left:
            self._reduce(b)
        if self.is_gradient_accumulation_boundary:
            self._boundary_reduced = True

    def _reduces_now(self) -> bool:
        return (self.policy.shard_grads or self.is_gradient_accumulation_boundary) and self._average_now

    def _reduce(self, b: int) -> None:
        """Start bucket ``b``'s reduction: gradients × 1/world_size (DDP's arithmetic; 1/gradient_averaging_size
        when given), summed by an
        all-reduce (stage 0) or a reduce-scatter into this rank's shard (stages 1-2). In place at
        stages 0-1 when the reduction dtype is the gradients'; else through a staging buffer."""
        if not self._reduces_now():
            return
        self._reduced[b] = True
        bucket, group = self.layout.buckets[b], self._bucket_groups[b]  # ZeRO's group, or the bucket's replicas'
        # whatever the group: DeepSpeed's averaging of replicated (expert) gradients; the data-parallel size with
        # sequence parallelism (summed over the sequence ranks, averaged over the data ranks)
        scale = 1.0 / self.gradient_averaging_size
        mine = self._shard_grads[b]  # this rank's reduced gradients of the bucket end up here
        if self.policy.whole_grads:
            self._slots.sync(bucket.slots)  # every .grad in the buffer (a replaced one copied, a cleared one zero)
            grads = self._grads[bucket.offset:bucket.offset + bucket.padded]
            if not self._bucket_buffers:  # stage 0: all-reduced in place, DDP's arithmetic
                grads.mul_(scale)
                work = ds_comm.all_reduce(grads, group=group, async_op=True)
                self._work.append((work, self._landed(b, None)))
                return
            which, buffer = self._staging_buffer(bucket.padded)
            torch.mul(grads, scale, out=buffer)
        else:
            which, buffer = self._staging_buffer(bucket.padded)
            for index in bucket.slots:
                slot, param = self.layout.slots[index], self._params[index]
                target = buffer[slot.offset - bucket.offset:][:slot.numel]
                if param.grad is None:  # (a .grad held from another optimizer's backward counts: `_grad_slots`)
                    target.zero_()
                else:
                    torch.mul(param.grad.reshape(-1), scale, out=target)  # DDP's mul_out into its bucket
                param.grad = None  # the full-size gradient is not needed any more
                self._slots.reduced(index)
            if bucket.padded > bucket.numel:
                buffer[bucket.numel:].zero_()
            if self._stage3 is not None:  # backward is done with this unit's parameters
                self._stage3.after_reduction(b)
        if not self.policy.shard_optimizer:
            work = ds_comm.all_reduce(buffer, group=group, async_op=True)
            self._buffer_work[which] = (work, self._landed(b, lambda: grads.copy_(buffer)))
            return
        # The first micro-step of an accumulation writes the shard directly when the dtypes agree;
        # otherwise the reduce-scatter lands in a received buffer, then is copied or added. Stage 1 reduces
        # the whole local accumulation each time (.grad keeps it): its result replaces the shard's.
        first = self.policy.reduces_whole_accumulation or not self._accumulated
        if first and mine.dtype == buffer.dtype:
            work = ds_comm.reduce_scatter_bucket(buffer, mine, group=group, async_op=True)
            self._buffer_work[which] = (work, self._landed(b, None))
            return
        received = self._received_buffers()[which][:bucket.shard]
        work = ds_comm.reduce_scatter_bucket(buffer, received, group=group, async_op=True)
        self._buffer_work[which] = (work, self._landed(b, (lambda: mine.copy_(received)) if first else
                                                     (lambda: mine.add_(received))))

    def _landed(self, b: int, then: Callable | None) -> Callable | None:
        """What runs once bucket ``b``'s reduction has landed: ``then``, and under ZeRO-Offload at the
        accumulation boundary, the copy of this rank's reduced shard to the host (`_offload`)."""
        if self._host is None or not self.is_gradient_accumulation_boundary:
            return then

        def landed() -> None:
            if then is not None:
                then()
            self._host.download(b)

        return landed

    def _received_buffers(self) -> list[torch.Tensor]:
        """The received buffers, made on first use where `_make_reduction_buffers` saw no need for them (an
        accumulation decided by hand: set_gradient_accumulation_boundary or _steps)."""
        if not self._received:
            shard = max(b.shard for b in self.layout.buckets)
            self._received = [torch.zeros(shard, dtype=self.communication_data_type, device=self.device)
                              for _ in self._bucket_buffers]
        return self._received

    def _staging_buffer(self, length: int) -> tuple[int, torch.Tensor]:
        """The next bucket buffer (waiting for the reduction that still uses it, if any)."""
        which = self._next_buffer
        self._next_buffer = (which + 1) % len(self._bucket_buffers)
        if self._buffer_work[which] is not None:
            _complete(*self._buffer_work[which])
            self._buffer_work[which] = None
        return which, self._bucket_buffers[which][:length]

    def _wait_reductions(self) -> None:
        held = self._slots.take_held() if self.policy.shard_grads and self._average_now else []
        if held:  # gradients another optimizer's backward made and the user kept: reduced now (`_grad_slots`)
            self._fired = set(held)
            for b in sorted({self._bucket_of[id(self._params[i])] for i in held}):
                self._reduce(b)
        if not self._boundary_reduced and self._average_now:  # a backward in which no hook ran
            self._reduce_leftovers()
        if held:
            self._accumulated = True
            self._fired.clear()
            self._reduced = [False] * len(self.layout.buckets)
        self._boundary_reduced = False
        self._finish_in_flight()

    def wait_reductions(self) -> None:
        """Complete the gradient reductions backward has issued (they run in its hooks; `step` waits for
        them anyway): DeepSpeed's ``engine.allreduce_gradients()`` after backward."""
        self._finish_in_flight()

    def reduce_gradients(self) -> None:
        """Start the reduction of every bucket from the gradients in ``.grad`` (with
        ``reduce_in_backward=False``: the caller's backward passes are done); `step` waits for it. A
        parameter without a gradient counts as zeros."""
        if self.reduce_in_backward:
            raise RuntimeError("ZeroOptimizer.reduce_gradients: this optimizer reduces in its backward hooks; build it "
                               "with reduce_in_backward=False to reduce by hand")
        self._fired = {i for i, p in enumerate(self._params) if p.grad is not None}
        for b in range(len(self.layout.buckets)):
            self._reduce(b)
        self._boundary_reduced = True
        self._accumulated = True
        self._fired.clear()
        self._reduced = [False] * len(self.layout.buckets)

    def _finish_in_flight(self) -> None:
        """Complete every reduction issued and not yet waited for."""
        for pending in self._work:
            _complete(*pending)
        self._work.clear()
        for which, pending in enumerate(self._buffer_work):
            if pending is not None:
                _complete(*pending)
                self._buffer_work[which] = None

    def _grad_norm(self) -> torch.Tensor:
        """The global L2 norm as torch.nn.utils.clip_grad_norm_ computes it: the norm of the
        per-parameter norms (in float32 whatever the gradients' dtype; inf or nan when a gradient
        overflowed). Stage 0 holds every reduced gradient, so this is local and bitwise torch's; at
        stages 1-2 each parameter's sum of squares is gathered from its pieces first. With a
        ``model_parallel_group`` (pipeline stages) the other parts' squares are added, and a copy of a
        weight another stage owns (``ds_pipe_replicated``, a tied weight) is left out, as in DeepSpeed; so is,
        on tensor-parallel ranks other than 0, a parameter without Megatron's ``tensor_model_parallel`` mark
        (replicated: the same on every tensor-parallel rank, counted once, as DeepSpeed's
        is_model_parallel_parameter rule).
        Parameters replicated over subgroups (`_replicas`) count once: at stages 1-2 their pieces split
        them over their group, at stage 0 each group's first rank counts them (`_replicated_norm`)."""
        first = self.tensor_parallel_rank == 0
        counted = [not getattr(p, "ds_pipe_replicated", False) and (first or _sliced(p)) for p in self._params]
        if not self.policy.shard_optimizer and self._replica_groups:
            norm = self._replicated_norm(counted)
        elif not self.policy.shard_optimizer:
            grads = [p.grad for p, c in zip(self._params, counted, strict=True) if c]
            if self.dtype == torch.float32:
                norms = torch._foreach_norm(grads)
            else:
                norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
            norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else \
                torch.zeros((), dtype=torch.float32, device=self.device)
        else:
            squares = torch.zeros(len(self._params), dtype=torch.float32, device=self.device)
            for piece in self._pieces:
                if not counted[piece.index]:
                    continue
                shard = self._shard_grads[piece.bucket]
                part = shard[piece.partition_offset - self._shard_starts[piece.bucket]:][:piece.numel]
                if part.dtype == torch.float32:
                    squares[piece.index] += torch.dot(part, part)
                else:
                    squares[piece.index] += torch.linalg.vector_norm(part, dtype=torch.float32).square()
            ds_comm.all_reduce(squares, group=self.group)
            norm = torch.linalg.vector_norm(squares.sqrt())
        if self.model_parallel_group is not None and ds_comm.get_world_size(self.model_parallel_group) > 1:
            total = norm.square()
            ds_comm.all_reduce(total, group=self.model_parallel_group)
            norm = total.sqrt()
        return norm

    def _replicated_norm(self, counted: list[bool]) -> torch.Tensor:
        """Stage 0 with replicated parameters: each rank holds its parameters' whole reduced gradients,
        the same on every rank of a parameter's group and different between groups. The first rank of each
        bucket's group adds the squares of its parameters' norms; one all-reduce over ZeRO's group sums them
        (an inf or NaN anywhere reaches every rank)."""
        first = {b: bucket.ranks[0] == self.rank for b, bucket in enumerate(self.layout.buckets)}
        grads = [p.grad for p, slot, c in zip(self._params, self.layout.slots, counted, strict=True)
                 if c and first[slot.bucket]]
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:
            norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
            total = torch.stack(norms).square().sum()
        ds_comm.all_reduce(total, group=self.group)
        return total.sqrt()

    def _wait_reductions_quietly(self) -> None:
        """Complete reductions still in flight (a close between backward and step), so no
        collective is left half-issued on this rank."""
        try:
            for pending in [*self._work, *(w for w in self._buffer_work if w is not None)]:
                _complete(*pending)
        except Exception as e:  # the group may be gone already; nothing to finish then
            logger.debug("ZeroOptimizer.close: pending reductions not completed (%s)", e)

    def _mask_padding(self) -> None:
        """Tell a 1-bit optimizer where the parameters lie in each group's flat tensor (its runs, in
        order): the buckets' padding stays zero (compressed, it would not), and 1-bit LAMB takes its trust
        ratios per parameter."""
        where = {id(t): at for t, (at, _) in zip(self._step_params, self._owned, strict=True)}
        slots = sorted(self.layout.slots, key=lambda slot: slot.offset)
        for index, group in enumerate(self.optimizer.param_groups):
            segments, base = [], 0
            for t in group["params"]:  # a run holds whole parameters at stage 0
                start, end = where[id(t)], where[id(t)] + t.numel()
                segments += [(base + slot.offset - start, slot.numel) for slot in slots
                             if start <= slot.offset < end]
                base += t.numel()
            if group["params"]:
                self.optimizer.set_segments(index, segments)

    def _refresh_parameters(self) -> None:
        """After the stepped part changed: every rank's shards into the parameters (stages 1-2), or
        into the units gathered now (stage 3: the others are gathered when used)."""
        if self._stage3 is not None:
            self._stage3.after_step()
        elif self.policy.shard_optimizer:
            self._gather_parameters()

    def _gather_parameters(self) -> None:
        """Every rank's updated shards into every rank's parameters: one in-place all-gather per
        bucket (the rank's shard already sits in its place), all in flight at once."""
        works = [ds_comm.all_gather_bucket(self._flat[b.offset:b.offset + b.padded], group=group, async_op=True)
                 for b, group in zip(self.layout.buckets, self._bucket_groups, strict=True)]
        for work in works:
            work.wait()

    def _next_reduction(self) -> None:
        """Whether the next accumulation's gradients are averaged (a 1-bit optimizer decides)."""
        if self._compressed:
            self._average_now = self.optimizer.wants_averaged_gradients()


def _sliced(param: torch.Tensor) -> bool:
    """Whether ``param`` is a tensor-parallel slice (Megatron's ``tensor_model_parallel`` mark, or the older
    ``model_parallel``), as DeepSpeed's is_model_parallel_parameter asks."""
    return bool(getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False))


def _complete(work: Any, then: Callable | None) -> None:
    work.wait()
    if then is not None:
        then()
