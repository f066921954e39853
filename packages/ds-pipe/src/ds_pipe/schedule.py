"""Pipeline schedules as pure instruction streams: 1F1B, inference, interleaved 1F1B, zero-bubble ZB-H1.

A schedule is built from ``(micro_batches, stages, stage_id)`` and yields, for that one stage, the
instructions to run in order: iterating the schedule (or ``steps()``) gives them grouped as DeepSpeed
does (one list per step), ``instructions()`` flattened. Nothing here touches a tensor or a process, so a schedule
can be printed (`print_schedule`), simulated (``ds_pipe._simulate``) and tested on its own.

Semantics (what the executor relies on):

* With ``p`` stages and ``v`` chunks per stage (interleaved; ``v = 1`` otherwise), chunk ``c`` of stage
  ``s`` is virtual stage ``c*p + s`` (Megatron's layout): the model is cut into ``p*v`` consecutive
  parts in virtual-stage order.
* ``LoadMicroBatch(m, c)`` appears on the chunk holding virtual stage 0 (it loads the inputs) and on
  the one holding the last virtual stage (it loads the labels), before that micro-batch's forward there.
* ``ForwardPass(m, c)`` runs chunk ``c`` on micro-batch ``m``. ``RecvActivation(m, c)`` receives chunk
  ``c``'s input from the previous virtual stage (stage ``s-1`` chunk ``c``; for ``s == 0, c > 0``, stage
  ``p-1`` chunk ``c-1``) before that forward; ``SendActivation(m, c)`` sends chunk ``c``'s output to the
  next virtual stage, after it. Neither appears where there is no such virtual stage.
* ``RecvGrad(m, c)`` receives the gradient of chunk ``c``'s output from the next virtual stage before the
  backward; ``SendGrad(m, c)`` sends the gradient of chunk ``c``'s input to the previous virtual stage
  after the backward (after ``BackwardInput`` in the zero-bubble schedule).
* ``BackwardPass`` is the full backward; the zero-bubble schedule splits it into ``BackwardInput``
  (input gradients) and, later, ``BackwardWeight`` (weight gradients), each once per micro-batch and chunk.
* Between two ranks, messages of one kind (activation / gradient) across one virtual-stage boundary
  arrive in the order they were sent: for every boundary the sender's micro-batch order equals the
  receiver's. Every stream also runs when sends block until the matching receive is reached (a
  rendezvous, like gloo's blocking send): all stages order their messages by one global key (see
  `_with_messages`), so no cycle of waits can form. A receive sits just before the pass that needs
  it; a send follows the pass that produced it, sometimes after a later pass of the same stage.
* Messages are placed for reference costs F=1, B=2, Bi=W=1; at those costs the streams run as fast as
  their pass orders allow. At other costs they still run; 1F1B and ZB-H1 lose no time, the interleaved
  streams lose a little at some cost ratios against a placement of every message right next to its
  pass (which deadlocks on rendezvous): in simulation at most 1.5% of the makespan at B = 2.2F and 6%
  at B = 3F, nothing at B = F, 1.5F or 2F.
* Training streams end with ``ReduceTiedGrads``, ``ReduceGrads``, ``OptimizerStep`` on every stage.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

# -- instructions ---------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class PipeInstruction:
    """Base of every pipeline instruction."""

    def __repr__(self) -> str:
        return type(self).__name__


@dataclass(frozen=True, repr=False)
class _MicroBatchInstruction(PipeInstruction):
    """An instruction about one micro-batch on one of this stage's chunks; ``label`` names it in tables."""

    micro_batch: int
    chunk: int = 0
    label: ClassVar[str] = "?"

    def __repr__(self) -> str:
        return f"{self.label}{self.micro_batch}" + (f".c{self.chunk}" if self.chunk else "")


class LoadMicroBatch(_MicroBatchInstruction):
    label = "L"


class ForwardPass(_MicroBatchInstruction):
    label = "F"


class BackwardPass(_MicroBatchInstruction):
    label = "B"


class BackwardInput(_MicroBatchInstruction):
    label = "Bi"


class BackwardWeight(_MicroBatchInstruction):
    label = "W"


class SendActivation(_MicroBatchInstruction):
    label = "SA"


class RecvActivation(_MicroBatchInstruction):
    label = "RA"


class SendGrad(_MicroBatchInstruction):
    label = "SG"


class RecvGrad(_MicroBatchInstruction):
    label = "RG"


class ReduceTiedGrads(PipeInstruction):
    """All-reduce the gradients of tied weights over the stages sharing them (once per batch)."""


class ReduceGrads(PipeInstruction):
    """Reduce the gradients over data-parallel replicas (once per batch)."""


class OptimizerStep(PipeInstruction):
    """Step the optimizer (once per batch)."""


# -- schedules ------------------------------------------------------------------------------------

# A schedule decides the order of its stage's compute passes, ``(kind, micro_batch, chunk)`` with kind
# one of "F", "B", "Bi", "W" (`_order`); `PipeSchedule.steps` then places the loads, sends and receives.
_PASSES = {"F": ForwardPass, "B": BackwardPass, "Bi": BackwardInput, "W": BackwardWeight}
_REFERENCE_COSTS = {"F": 1, "B": 2, "Bi": 1, "W": 1}


def _require_int(owner: str, name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}")


def _pass_times(orders: list[list[tuple]], stages: int, chunks: int) -> dict[tuple, tuple[int, int]]:
    """``(kind, micro_batch, virtual_stage) -> (start, end)`` of every pass when each stage runs its order
    as soon as its input is there, at the reference costs (F=1, B=2, Bi=W=1; messages take no time)."""
    last = stages * chunks - 1
    times: dict[tuple, tuple[int, int]] = {}
    clock, done = [0] * stages, [0] * stages
    moved = True
    while moved:
        moved = False
        for s, order in enumerate(orders):
            while done[s] < len(order):
                kind, m, c = order[done[s]]
                virtual = c * stages + s
                source = {"F": virtual - 1, "B": virtual + 1, "Bi": virtual + 1}.get(kind, -1)
                needs = (kind, m, source) if 0 <= source <= last else None  # the pass whose output it takes
                if needs is not None and needs not in times:
                    break
                start = max(clock[s], times[needs][1] if needs else 0)
                clock[s] = start + _REFERENCE_COSTS[kind]
                times[kind, m, virtual] = (start, clock[s])
                done[s] += 1
                moved = True
    if any(done[s] < len(order) for s, order in enumerate(orders)):
        raise RuntimeError(f"ds_pipe.schedule: the pass orders cannot run, stages stop at "
                           f"{[order[d] if d < len(order) else None for d, order in zip(done, orders, strict=True)]}")
    return times


def _with_messages(orders: list[list[tuple]], stage_id: int, chunks: int) -> Iterator[list[PipeInstruction]]:
    """Stage ``stage_id``'s steps: each pass of ``orders[stage_id]`` with its load, sends and receives.

    Every message is keyed by the time its receiving pass starts when all stages run their orders as
    soon as possible at the reference costs (`_pass_times`), ties broken by kind, sending virtual stage
    and micro-batch. A stage makes its sends and receives in key order and runs each pass as soon as
    that order allows: right after its own receive and the sends (of earlier passes) keyed before it.
    So a receive sits just before the pass that needs it and a send goes out as early as the order
    lets it. At the reference costs the streams run exactly as fast as the pass orders allow. As every
    stage orders its messages by one global key, no cycle of waits can form: the streams run even when
    each send blocks until its receive is reached (at any costs), and both ends of a boundary see its
    micro-batches in the same order. (A pass's receive is keyed at its start and its sends at or after
    its end, so the key order never asks for a send before its pass nor a receive after it.)"""
    stages, s = len(orders), stage_id
    last = stages * chunks - 1
    times = _pass_times(orders, stages, chunks)
    messages = []  # (key, index of its pass in this stage's order, is_send, instruction)
    for index, (kind, m, c) in enumerate(orders[s]):
        virtual = c * stages + s
        if kind == "F" and virtual > 0:
            messages.append(((times["F", m, virtual][0], 0, virtual - 1, m), index, False, RecvActivation(m, c)))
        if kind == "F" and virtual < last:
            messages.append(((times["F", m, virtual + 1][0], 0, virtual, m), index, True, SendActivation(m, c)))
        if kind in ("B", "Bi") and virtual < last:
            messages.append(((times[kind, m, virtual][0], 1, virtual + 1, m), index, False, RecvGrad(m, c)))
        if kind in ("B", "Bi") and virtual > 0:
            messages.append(((times[kind, m, virtual - 1][0], 1, virtual, m), index, True, SendGrad(m, c)))
    messages.sort(key=lambda message: message[0])
    placed = 0
    for index, (kind, m, c) in enumerate(orders[s]):
        step: list[PipeInstruction] = []
        while placed < len(messages) and (messages[placed][1] < index if messages[placed][2]
                                          else messages[placed][1] == index):
            step.append(messages[placed][3])
            placed += 1
        if kind == "F" and c * stages + s in (0, last):
            step.append(LoadMicroBatch(m, c))
        step.append(_PASSES[kind](m, c))
        yield step
    if placed < len(messages):
        yield [message[3] for message in messages[placed:]]


class PipeSchedule:
    """Base of the schedules: argument checks; `steps` from the stages' pass orders (`_order`)."""

    train = True

    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        owner = type(self).__name__
        _require_int(owner, "micro_batches", micro_batches, 1)
        _require_int(owner, "stages", stages, 1)
        _require_int(owner, "stage_id", stage_id, 0)
        if stage_id >= stages:
            raise ValueError(f"{owner}: stage_id must be in 0..{stages - 1} (stages={stages}), got {stage_id}")
        self.micro_batches, self.stages, self.stage_id = micro_batches, stages, stage_id
        self.prev_stage, self.next_stage = stage_id - 1, stage_id + 1  # DeepSpeed's (out of range at the ends)
        self.chunks = 1

    # DeepSpeed's read-only views of the three numbers
    @property
    def stage(self) -> int:
        """The stage this schedule is for (``stage_id``)."""
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def _order(self, stage_id: int) -> list[tuple[str, int, int]]:
        """Stage ``stage_id``'s compute passes ``(kind, micro_batch, chunk)``, in order."""
        raise NotImplementedError

    def num_pipe_buffers(self) -> int:
        """The most micro-batches whose forward activations this stage holds at once."""
        raise NotImplementedError

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """This stage's instructions, one list per step (a pass with its messages and load)."""
        orders = [self._order(stage) for stage in range(self.stages)]
        yield from _with_messages(orders, self.stage_id, self.chunks)
        if self.train:
            yield [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        """The steps, as DeepSpeed's schedules iterate (``for cmds in schedule``: one list per step)."""
        return self.steps()

    def instructions(self) -> Iterator[PipeInstruction]:
        """The steps' instructions one after another (the stream an executor runs)."""
        for step in self.steps():
            yield from step

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(micro_batches={self.micro_batches}, stages={self.stages}, "
                f"stage_id={self.stage_id})")


def _one_f_one_b(micro_batches: int, stages: int, stage_id: int, backward: str = "B") -> list:
    """1F1B's pass order: warm up with forwards, alternate forward/backward, cool down with backwards."""
    warmup = min(stages - stage_id - 1, micro_batches)
    order = [("F", m, 0) for m in range(warmup)]
    for i in range(micro_batches - warmup):
        order += [("F", warmup + i, 0), (backward, i, 0)]
    return order + [(backward, m, 0) for m in range(micro_batches - warmup, micro_batches)]


class TrainSchedule(PipeSchedule):
    """1F1B (PipeDream-Flush): stage ``s`` warms up with ``min(p - s - 1, m)`` forwards, then runs one
    forward and one backward in turn, and cools down with the remaining backwards. It holds at most
    ``min(p - s, m)`` micro-batches' activations; its bubble is ``(p - 1) / (m + p - 1)`` of the time."""

    def _order(self, stage_id):
        return _one_f_one_b(self.micro_batches, self.stages, stage_id)

    def num_pipe_buffers(self) -> int:
        return min(self.stages - self.stage_id, self.micro_batches)


class InferenceSchedule(PipeSchedule):
    """Forwards only: load / receive, forward, send, micro-batch after micro-batch."""

    train = False

    def _order(self, stage_id):
        return [("F", m, 0) for m in range(self.micro_batches)]

    def num_pipe_buffers(self) -> int:
        # nothing waits for a backward: one buffer receives while the other is forwarded and sent
        return 2


class InterleavedSchedule(PipeSchedule):
    """Megatron's interleaved 1F1B: each stage holds ``chunks`` (v) model chunks, virtual stages
    ``s, p + s, 2p + s, ...``. Forwards go in groups of ``p`` micro-batches, chunk by chunk (group 0 on
    chunk 0, group 0 on chunk 1, ..., then group 1), backwards in the same order with the chunks
    reversed. Stage ``s`` warms up with ``2*(p - s - 1) + (v - 1)*p`` forwards (all ``m*v`` when fewer),
    then alternates as 1F1B does. Needs ``micro_batches`` to be a multiple of ``stages``; with
    ``chunks=1`` it is `TrainSchedule` (as Megatron, which then runs its non-interleaved schedule).
    At per-chunk costs F = 1, B = 2 its bubble is ``(p - 1) / (v*m + p - 1)`` of the time."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, *, chunks: int = 2):
        super().__init__(micro_batches, stages, stage_id)
        _require_int("InterleavedSchedule", "chunks", chunks, 1)
        if micro_batches < stages:
            raise ValueError(f"InterleavedSchedule: micro_batches must be >= stages, got micro_batches={micro_batches} "
                             f"< stages={stages}")
        if micro_batches % stages:
            raise ValueError(f"InterleavedSchedule: micro_batches must be a multiple of stages={stages} (micro-batches "
                             f"go through the chunks in groups of {stages}), got micro_batches={micro_batches}")
        if stages == 1 and chunks > 1:
            raise ValueError(f"InterleavedSchedule: chunks > 1 needs stages >= 2 (with one stage every chunk is on "
                             f"the same rank, nothing to interleave), got stages=1, chunks={chunks}")
        self.chunks = chunks

    def _warmup(self, stage_id: int) -> int:
        p, v = self.stages, self.chunks
        return min(2 * (p - stage_id - 1) + (v - 1) * p, self.micro_batches * v)

    def _pass(self, k: int, backward: bool) -> tuple[int, int]:
        """The (micro_batch, chunk) of a stage's k-th forward (or backward)."""
        p, v = self.stages, self.chunks
        group, position = divmod(k, p * v)
        chunk = position // p
        return group * p + position % p, (v - 1 - chunk) if backward else chunk

    def _order(self, stage_id):
        if self.chunks == 1:
            return _one_f_one_b(self.micro_batches, self.stages, stage_id)
        total, warmup = self.micro_batches * self.chunks, self._warmup(stage_id)
        order = [("F", *self._pass(k, False)) for k in range(warmup)]
        for k in range(total - warmup):
            order += [("F", *self._pass(warmup + k, False)), ("B", *self._pass(k, True))]
        return order + [("B", *self._pass(k, True)) for k in range(total - warmup, total)]

    def num_pipe_buffers(self) -> int:
        if self.chunks == 1:
            return min(self.stages - self.stage_id, self.micro_batches)
        return min(self._warmup(self.stage_id) + 1, self.micro_batches * self.chunks)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", chunks={self.chunks})"


class ZeroBubbleSchedule(PipeSchedule):
    """ZB-H1 (Qi et al., 2023, "Zero Bubble Pipeline Parallelism", section 2.1): 1F1B with the backward
    split into ``BackwardInput`` (on the critical path, sent upstream at once) and ``BackwardWeight``.
    Stage ``s`` runs its weight passes ``s`` micro-batches late, so the last stages keep going while
    the gradients travel up, and catches up with them in the cooldown, where they fill 1F1B's bubble.

    Memory, counting a micro-batch as held from its forward to its weight pass: every stage holds
    ``min(p, m)``, which is 1F1B's peak (its stage 0), as the paper states ("the maximum peak memory
    usage over all workers doesn't exceed that of 1F1B"); of those, only ``p - s`` wait for their input
    backward, the other ``s`` keep just what the weight pass needs. (Holding stage ``s`` to 1F1B's own
    ``p - s`` would force the last stage into F, Bi, W strictly in turn and cost ``p - 1`` more time.)
    At unit costs F = Bi = W = 1 and ``m >= p`` it takes ``3m + p - 1``: a bubble of ``p - 1``, a third
    of 1F1B's ``3(p - 1)`` at F = 1, B = 2."""

    def _order(self, stage_id):
        m, s = self.micro_batches, stage_id
        order, weights = [], 0  # weight passes placed so far
        for kind, mb, c in _one_f_one_b(m, self.stages, s, backward="Bi"):
            order.append((kind, mb, c))
            if kind == "Bi" and mb >= s:  # the weight pass s micro-batches behind this input pass
                order.append(("W", weights, 0))
                weights += 1
        return order + [("W", mb, 0) for mb in range(weights, m)]

    def num_pipe_buffers(self) -> int:
        return min(self.stages, self.micro_batches)


class DataParallelSchedule(PipeSchedule):
    """DeepSpeed's example schedule: plain data parallelism with gradient accumulation on one stage. Each
    step loads, forwards and backwards one micro-batch; the last also reduces the gradients and steps the
    optimizer (no tied weights on one stage, so no ``ReduceTiedGrads``)."""

    def __init__(self, micro_batches: int, stages: int = 1, stage_id: int = 0):
        super().__init__(micro_batches, stages, stage_id)
        if stages != 1:
            raise ValueError(f"DataParallelSchedule: stages must be 1 (it sends nothing between stages), got {stages}")

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for m in range(self.micro_batches):
            step: list[PipeInstruction] = [LoadMicroBatch(m), ForwardPass(m), BackwardPass(m)]
            if m == self.micro_batches - 1:
                step += [ReduceGrads(), OptimizerStep()]
            yield step

    def num_pipe_buffers(self) -> int:
        return 1


# -- drawing --------------------------------------------------------------------------------------


def print_schedule(schedule_cls: type[PipeSchedule], stages: int, micro_batches: int, **kwargs) -> str:
    """A time x stage table of ``schedule_cls``'s compute passes, simulated at unit costs (every pass takes
    one slot, messages none, sends buffered); ``.`` marks an idle slot. Returns the text (print it)."""
    from ._simulate import simulate  # _simulate imports the instructions from here

    streams = [list(schedule_cls(micro_batches, stages, s, **kwargs).instructions()) for s in range(stages)]
    timeline = simulate(streams, chunks=kwargs.get("chunks", 1), costs={"F": 1, "B": 1, "Bi": 1, "W": 1})
    slots = int(timeline.makespan)
    rows = []
    for spans in timeline.spans:
        cells = ["."] * slots
        for start, _end, instruction in spans:
            cells[int(start)] = repr(instruction)
        rows.append(cells)
    width = max(len(cell) for row in rows for cell in row)
    label = len(f"stage {stages - 1}")
    return "\n".join(f"{f'stage {s}':<{label}} | " + " ".join(cell.ljust(width) for cell in row).rstrip()
                     for s, row in enumerate(rows))
