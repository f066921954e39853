"""`PipelineExecutor`: runs a `PipelineModule`'s stage through a schedule's instruction stream.

Each rank executes its own stream in order: loads micro-batches, runs forwards and backwards, and
talks to its neighbours through `_p2p.Channel`. What happens to the gradients at the end is the
caller's: ``reduce_grads(executor)`` (default: a bucketed all-reduce averaging over the data-parallel
group) and ``optimizer_step(executor)`` (default: the torch optimizer's ``step`` and ``zero_grad``);
``backward(tensors, grad_tensors)`` (default ``torch.autograd.backward``) lets the engine in ds-all
put ZeRO's reduction and loss scaling there.

Before the gradients are reduced, every rank agrees that the batch went well (one small all-reduce
that also carries the loss to every stage); a rank that failed has told its neighbours already, so
every rank raises and none waits forever.

The stage's tensors live on its device (the module's: `PipelineModule` is built on the stage's device):
micro-batches read from ``data_iter`` are moved there (DeepSpeed's PipelineEngine does), and every
buffer the executor allocates is made there, or on the channel's wire device (NCCL: the same).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import ds_comm

from . import schedule as S
from ._device import backend_of, module_device, wire_device
from ._module import PipelineModule
from ._p2p import ACTIVATION, GRAD, Channel, PeerFailed
from ._partition import join_first, split_first
from ._zero_bubble import DeferredLinearGrads

logger = logging.getLogger(__name__)

SCHEDULES = {"1f1b": S.TrainSchedule, "interleaved": S.InterleavedSchedule, "zero_bubble": S.ZeroBubbleSchedule}
_END = (S.ReduceTiedGrads, S.ReduceGrads, S.OptimizerStep)


def _as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _to_device(x: Any, device: torch.device) -> Any:
    """``x`` with its tensors (in tuples, lists and dicts too) on ``device``; the same objects where they
    are there already (always on the CPU)."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)  # asynchronous from a pinned batch
    if isinstance(x, (tuple, list)):
        return type(x)(_to_device(item, device) for item in x)
    if isinstance(x, dict):
        return {key: _to_device(value, device) for key, value in x.items()}
    return x


def _mean_loss(losses: list[torch.Tensor]) -> torch.Tensor:
    """The micro-batches' mean loss as DeepSpeed's pipeline reports it: summed in order in the losses'
    dtype (float32 at least: ds does not sum 16-bit losses in 16 bits), then divided by their count.
    A mean taken in float64 is up to a few float32 ulps away from DeepSpeed's value at the same weights."""
    total = torch.zeros((), dtype=torch.promote_types(losses[0].dtype, torch.float32), device=losses[0].device)
    for loss in losses:
        total += loss.detach().reshape(())
    return total / len(losses)


class PipelineExecutor:
    """Train and evaluate a `PipelineModule` a global batch at a time.

    ``micro_batches``: micro-batches per batch (DeepSpeed's gradient accumulation steps); ``schedule``:
    ``"1f1b"``, ``"interleaved"`` (the module built with ``virtual_stages`` > 1) or ``"zero_bubble"``.
    ``data_iter`` yields ``(inputs, labels)`` per micro-batch; the first stage reads the inputs, the last
    the labels, the others nothing.

    With tensor-parallel stages (a topology with a ``model`` axis of size ``tp`` > 1) the activations and
    gradients sent between stages are the same whole tensors on every tensor-parallel rank; with
    ``pipe_partitioned`` (``grad_partitioned``) each rank sends its ``1 / tp`` part of a message's first
    activation (gradient) and the receiving stage all-gathers the parts over its tensor-parallel group
    (DeepSpeed's keys and defaults, `_partition`); without them every rank sends the whole tensor.
    """

    def __init__(self, module: PipelineModule, optimizer: torch.optim.Optimizer | None = None, *,
                 micro_batches: int, schedule: str = "1f1b",
                 reduce_grads: Callable[[PipelineExecutor], None] | None = None,
                 optimizer_step: Callable[[PipelineExecutor], None] | None = None,
                 backward: Callable | None = None, reduce_bucket_size: int = 500_000_000,
                 pipe_partitioned: bool = True, grad_partitioned: bool = True):
        if not isinstance(module, PipelineModule):
            raise ValueError(f"PipelineExecutor: module must be a PipelineModule, got {type(module).__name__}")
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"PipelineExecutor: micro_batches must be a positive integer, got {micro_batches!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"PipelineExecutor: schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        if module.virtual_stages > 1 and schedule != "interleaved":
            raise ValueError(f"PipelineExecutor: the module has virtual_stages={module.virtual_stages}, which only "
                             f"the 'interleaved' schedule runs; got schedule {schedule!r}")
        if schedule == "zero_bubble" and module.activation_checkpoint_interval:
            raise ValueError("PipelineExecutor: the 'zero_bubble' schedule does not run with activation checkpointing "
                             f"(activation_checkpoint_interval={module.activation_checkpoint_interval}); use '1f1b'")
        if not isinstance(reduce_bucket_size, int) or reduce_bucket_size < 1:
            raise ValueError(f"PipelineExecutor: reduce_bucket_size must be a positive integer, got {reduce_bucket_size!r}")
        self.module, self.optimizer, self.micro_batches, self.schedule_name = module, optimizer, micro_batches, schedule
        self.grid = module.mpu()
        self.stage_id, self.stages, self.chunks = module.stage_id, module.num_stages, module.virtual_stages
        self.reduce_bucket_size = reduce_bucket_size
        for name, value in (("pipe_partitioned", pipe_partitioned), ("grad_partitioned", grad_partitioned)):
            if not isinstance(value, bool):
                raise ValueError(f"PipelineExecutor: {name} must be True or False, got {value!r}")
        self.tp_group = self.grid.get_model_parallel_group()
        self.tp_size, self.tp_rank = self.grid.get_model_parallel_world_size(), self.grid.get_model_parallel_rank()
        self.pipe_partitioned = pipe_partitioned and self.tp_size > 1
        self.grad_partitioned = grad_partitioned and self.tp_size > 1
        self._reduce_grads = reduce_grads or PipelineExecutor.allreduce_gradients
        self._optimizer_step = optimizer_step or PipelineExecutor.default_optimizer_step
        self._backward = backward or (lambda tensors, grads: torch.autograd.backward(tensors, grads))
        kwargs = {"chunks": self.chunks} if schedule == "interleaved" else {}
        self._train_stream = list(SCHEDULES[schedule](micro_batches, self.stages, self.stage_id, **kwargs).instructions())
        self._eval_stream = None
        # the executor's own group (every rank creates it, in the same order): its messages and its
        # agreement never meet another executor's, even the leftovers of a failed batch
        self.group = ds_comm.new_group(list(range(ds_comm.get_world_size())))
        self.device = module_device(module)  # the stage's: its micro-batches and buffers go there
        self.channel = Channel(ds_comm.get_rank(), self._describe_rank, self.group, module.dynamic_shape,
                               device=self.device, wire=wire_device(self.device, backend_of(self.group, self.device)))
        self._deferred = DeferredLinearGrads([module]) if schedule == "zero_bubble" else None
        self._broken: str | None = None
        self.global_steps = 0
        self.timings: dict[str, float] = {}

    def set_micro_batches(self, micro_batches: int) -> None:
        """Run ``micro_batches`` per batch from now on (DeepSpeed's ``set_train_batch_size`` changes the
        accumulation steps so): the schedule's streams are built again."""
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"PipelineExecutor: micro_batches must be a positive integer, got {micro_batches!r}")
        kwargs = {"chunks": self.chunks} if self.schedule_name == "interleaved" else {}
        stream = list(SCHEDULES[self.schedule_name](micro_batches, self.stages, self.stage_id, **kwargs).instructions())
        self.micro_batches, self._train_stream, self._eval_stream = micro_batches, stream, None

    def reset_activation_shape(self) -> None:
        """The next batch may send activations and gradients of other shapes than the last (DeepSpeed's
        name; a sequence length that grows, say). Every rank calls it between batches."""
        self.channel.forget_shapes()

    # -- topology -------------------------------------------------------------------------------
    def _describe_rank(self, rank: int) -> str:
        return f"stage {self.grid.topology.get_coord(rank).pipe} (rank {rank})"

    def _virtual(self, chunk: int) -> int:
        return chunk * self.stages + self.stage_id

    def is_first_virtual(self, chunk: int) -> bool:
        return self._virtual(chunk) == 0

    def is_last_virtual(self, chunk: int) -> bool:
        return self._virtual(chunk) == self.stages * self.chunks - 1

    def _rank_of_virtual(self, virtual: int) -> int:
        return self.grid.stage_to_global(virtual % self.stages)

    def _neighbours(self) -> set[int]:
        return {self.grid.stage_to_global(s) for s in (self.stage_id - 1, self.stage_id + 1, 0, self.stages - 1)
                if 0 <= s < self.stages and (abs(s - self.stage_id) == 1 or self.chunks > 1)}

    # -- the two entry points -------------------------------------------------------------------
    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One global batch: forward and backward of every micro-batch, gradient reduction, optimizer
        step. Returns the mean loss over micro-batches (and data-parallel replicas) on every stage."""
        if self.optimizer is None and self._optimizer_step is PipelineExecutor.default_optimizer_step:
            raise ValueError("PipelineExecutor.train_batch: give an optimizer or an optimizer_step hook")
        self.module.train()
        loss = self._run(self._train_stream, data_iter, train=True)
        self.global_steps += 1
        return loss

    def eval_batch(self, data_iter: Iterator | None = None, return_logits: bool = False):
        """Forward every micro-batch without gradients. Returns the mean loss on every stage (None when
        the module has no loss_fn), and with ``return_logits`` the last stage's outputs per micro-batch
        (None on other stages) as ``(loss, outputs)``."""
        if self._eval_stream is None:
            self._eval_stream = (list(S.InferenceSchedule(self.micro_batches, self.stages, self.stage_id).instructions())
                                 if self.chunks == 1 else self._chunked_inference_stream())
        self.module.eval()
        try:
            with torch.no_grad():
                loss = self._run(self._eval_stream, data_iter, train=False)
        finally:
            self.module.train()
        outputs = self._eval_outputs if self.is_last_virtual(self.chunks - 1) else None
        return (loss, outputs) if return_logits else loss

    def _chunked_inference_stream(self) -> list:
        """Forward-only with virtual stages: every micro-batch through chunk 0, then chunk 1, ... (sends
        do not block here, so this order cannot deadlock)."""
        stream = []
        for c in range(self.chunks):
            for m in range(self.micro_batches):
                if self.is_first_virtual(c) or self.is_last_virtual(c):
                    stream.append(S.LoadMicroBatch(m, c))
                if not self.is_first_virtual(c):
                    stream.append(S.RecvActivation(m, c))
                stream.append(S.ForwardPass(m, c))
                if not self.is_last_virtual(c):
                    stream.append(S.SendActivation(m, c))
        return stream

    # -- running a stream -----------------------------------------------------------------------
    def _run(self, stream: list, data_iter, train: bool) -> torch.Tensor | None:
        if self._broken:
            raise RuntimeError(f"PipelineExecutor: an earlier batch failed ({self._broken}); the pipeline's "
                               "messages are out of step, so no further batch can run")
        self._data_iter, self._train = data_iter, train
        self._batch: dict[int, Any] = {}
        self._inputs: dict[tuple, tuple] = {}
        self._outputs: dict[tuple, Any] = {}
        self._grads: dict[tuple, tuple] = {}
        self._input_grads: dict[tuple, tuple] = {}
        self._losses: list[torch.Tensor] = []
        self._eval_outputs = None if train else []
        busy = 0.0
        start = time.perf_counter()
        cut = next((i for i, ins in enumerate(stream) if isinstance(ins, _END)), len(stream))
        try:
            for instruction in stream[:cut]:
                t0 = time.perf_counter()
                getattr(self, "_exec_" + type(instruction).__name__)(instruction)
                if isinstance(instruction, (S.ForwardPass, S.BackwardPass, S.BackwardInput, S.BackwardWeight)):
                    busy += time.perf_counter() - t0
            if self._deferred is not None and self._deferred.pending():
                raise RuntimeError("ds_pipe: the schedule ended a batch with weight-gradient passes still pending")
        except Exception as error:
            message = (str(error) if isinstance(error, PeerFailed)
                       else f"{self._describe_rank(ds_comm.get_rank())}: {type(error).__name__}: {error}")
            self._broken = message
            self.channel.send_error(self._neighbours() - {getattr(error, "source", None)}, message)
            self._agree(failed=message)
            if isinstance(error, PeerFailed):
                raise PeerFailed(f"ds_pipe: a pipeline stage failed: {message}") from None
            raise
        loss = self._agree(failed=None)
        try:
            for instruction in stream[cut:]:
                self._end_instruction(instruction)
        except Exception as error:  # every rank got this far: a reduction or the step failed
            self._broken = f"{type(error).__name__}: {error}"
            raise
        self.timings = {"busy": busy, "total": time.perf_counter() - start}
        return loss

    def _agree(self, failed: str | None) -> torch.Tensor | None:
        """Every rank says whether its stream went well and what loss it saw (the last stages); all
        learn both. Raises on every healthy rank when another failed."""
        world = ds_comm.get_world_size()
        status = torch.zeros(world + 2, dtype=torch.float64, device=self.channel.wire)
        status[ds_comm.get_rank()] = 1.0 if failed else 0.0
        if self._losses:
            status[world] = _mean_loss(self._losses).double().to(status.device)
            status[world + 1] = 1.0
        ds_comm.all_reduce(status, group=self.group)
        host = status.cpu()  # read on the host once
        bad = [r for r in range(world) if host[r] > 0]
        if failed:
            return None
        if bad:
            self._broken = f"ranks {bad} failed"
            raise PeerFailed(f"ds_pipe: the batch failed on {', '.join(self._describe_rank(r) for r in bad)} "
                             "(its error is raised there)")
        self.channel.drain()
        if host[world + 1] == 0:
            return None
        return (status[world] / status[world + 1]).float()  # on the stage's wire device, as DeepSpeed's loss

    def _end_instruction(self, instruction) -> None:
        if isinstance(instruction, S.ReduceTiedGrads):
            self.module.allreduce_tied_weight_gradients()
        elif isinstance(instruction, S.ReduceGrads):
            self._reduce_grads(self)
        else:
            self._optimizer_step(self)

    # -- instructions ---------------------------------------------------------------------------
    def _exec_LoadMicroBatch(self, ins) -> None:
        m = ins.micro_batch
        if m not in self._batch:
            if self._data_iter is None:
                raise ValueError("PipelineExecutor: this stage loads data (it holds the first or last layers) but "
                                 "no data_iter was given")
            try:
                item = next(self._data_iter)
            except StopIteration:
                raise ValueError(f"PipelineExecutor: data_iter ran out at micro-batch {m} of "
                                 f"{self.micro_batches}") from None
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError("PipelineExecutor: data_iter must yield (inputs, labels) pairs, got "
                                 f"{type(item).__name__}" + (f" of length {len(item)}" if hasattr(item, '__len__') else ""))
            self._batch[m] = _to_device(tuple(item), self.device)
        if self.is_first_virtual(ins.chunk):
            self._inputs[(m, ins.chunk)] = _as_tuple(self._batch[m][0])

    def _exec_RecvActivation(self, ins) -> None:
        v = self._virtual(ins.chunk)
        received = self.channel.recv(self._rank_of_virtual(v - 1), ACTIVATION, ins.micro_batch, v)
        if self.pipe_partitioned:
            received = join_first(received, self.tp_group, self.tp_size)
        self._inputs[(ins.micro_batch, ins.chunk)] = received

    def _exec_ForwardPass(self, ins) -> None:
        key = (ins.micro_batch, ins.chunk)
        inputs = self._inputs[key]
        if not self._train:
            self._inputs.pop(key)
        if self._deferred is not None and self._train:
            self._deferred.current = key
        try:
            out = self.module(inputs[0] if len(inputs) == 1 else inputs, chunk=ins.chunk)
        finally:
            if self._deferred is not None:
                self._deferred.current = None
        if self.is_last_virtual(ins.chunk):
            labels = self._batch[ins.micro_batch][1]
            loss = self.module.loss_fn(out, labels) if self.module.loss_fn is not None else out
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
                if self.module.loss_fn is None and self._train:
                    raise ValueError("ds_pipe: the last stage's output is not a scalar loss and the PipelineModule "
                                     "has no loss_fn; give PipelineModule(loss_fn=...)")
                loss = None
            if loss is not None:
                self._losses.append(loss.detach())
            if not self._train:
                self._eval_outputs.append(out)
                return
            self._outputs[key] = (loss / self.micro_batches,)
            return
        self._outputs[key] = _as_tuple(out)

    def _exec_SendActivation(self, ins) -> None:
        key = (ins.micro_batch, ins.chunk)
        outputs = self._outputs[key] if self._train else self._outputs.pop(key)
        v = self._virtual(ins.chunk)
        if self.pipe_partitioned:
            outputs = split_first(outputs, self.tp_rank, self.tp_size)
        self.channel.send(self._rank_of_virtual(v + 1), ACTIVATION, ins.micro_batch, v + 1, outputs)

    def _exec_RecvGrad(self, ins) -> None:
        v = self._virtual(ins.chunk)
        key = (ins.micro_batch, ins.chunk)
        received = self.channel.recv(self._rank_of_virtual(v + 1), GRAD, ins.micro_batch, v + 1)
        if self.grad_partitioned and self._outputs[key][0].requires_grad:  # the first gradient is the first output's
            received = join_first(received, self.tp_group, self.tp_size)
        self._grads[key] = received

    def _backward_through(self, key) -> None:
        outputs = self._outputs.pop(key)
        if self.is_last_virtual(key[1]):
            tensors, grads = list(outputs), [None]
        else:
            received = iter(self._grads.pop(key))
            pairs = [(t, next(received)) for t in outputs if t.requires_grad]
            tensors, grads = [t for t, _ in pairs], [g for _, g in pairs]
        if tensors:
            self._backward(tensors, grads)

    def _keep_input_grads(self, key) -> None:
        inputs = self._inputs.pop(key)
        if self.is_first_virtual(key[1]):
            return
        self._input_grads[key] = (tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                                        for t in inputs if t.requires_grad), inputs[0].requires_grad)

    def _exec_BackwardPass(self, ins) -> None:
        key = (ins.micro_batch, ins.chunk)
        self._backward_through(key)
        self._keep_input_grads(key)

    def _exec_BackwardInput(self, ins) -> None:
        self._exec_BackwardPass(ins)  # the linear layers' weight gradients wait for BackwardWeight

    def _exec_BackwardWeight(self, ins) -> None:
        self._deferred.weight_pass(ins.micro_batch, ins.chunk)

    def _exec_SendGrad(self, ins) -> None:
        key = (ins.micro_batch, ins.chunk)
        v = self._virtual(ins.chunk)
        grads, first_has_grad = self._input_grads.pop(key)
        if self.grad_partitioned and first_has_grad:
            grads = split_first(grads, self.tp_rank, self.tp_size)
        self.channel.send(self._rank_of_virtual(v - 1), GRAD, ins.micro_batch, v, grads)

    # -- the default hooks ----------------------------------------------------------------------
    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    @staticmethod
    def allreduce_gradients(executor: PipelineExecutor) -> None:
        """Average this stage's gradients over its data-parallel group, in buckets of at most
        ``reduce_bucket_size`` elements (a missing gradient counts as zeros)."""
        dp = executor.grid.get_data_parallel_world_size()
        if dp == 1:
            return
        params = executor.parameters()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket, size = [], 0
        for p in [*params, None]:
            if p is None or (bucket and size + p.numel() > executor.reduce_bucket_size):
                if bucket:
                    ds_comm.all_reduce_coalesced(bucket, group=executor.grid.get_data_parallel_group())
                    torch._foreach_div_(bucket, dp)
                bucket, size = [], 0
            if p is not None:
                bucket.append(p.grad)
                size += p.numel()

    @staticmethod
    def default_optimizer_step(executor: PipelineExecutor) -> None:
        executor.optimizer.step()
        executor.optimizer.zero_grad(set_to_none=True)
