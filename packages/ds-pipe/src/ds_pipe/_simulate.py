"""Run a set of per-stage instruction streams on a clock, without tensors or processes.

`simulate` gives each stage its stream, in order: a compute pass (F, B, Bi, W) takes its cost, a load
and the once-per-batch instructions take no time, a message takes no time. A receive completes no
earlier than its send ran; a send completes at once (buffered) or, with ``blocking_sends``, only when
its receive is reached (a rendezvous, like gloo's blocking send). Messages of one kind across one
virtual-stage boundary are matched first-in first-out, as tagged point-to-point messages are; a receive
that meets another micro-batch than it expects is an error. When no stage can move and some are not
done, that is a deadlock: a `RuntimeError` names each stuck stage and where it waits.

`check` verifies that streams are a well-formed pipeline batch (see its docstring) and returns each
stage's peak number of micro-batches whose activations it holds.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .schedule import (
    BackwardInput,
    BackwardPass,
    BackwardWeight,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)

_COST_KEY = {ForwardPass: "F", BackwardPass: "B", BackwardInput: "Bi", BackwardWeight: "W"}
DEFAULT_COSTS = {"F": 1, "B": 2, "Bi": 1, "W": 1}
_END = (ReduceTiedGrads, ReduceGrads, OptimizerStep)


@dataclass(frozen=True)
class Timeline:
    """When each stage ran each compute pass. ``spans[s]`` lists stage ``s``'s ``(start, end, instruction)``.

    ``bubble_fraction`` is the idle share of the run averaged over the stages: the mean over ``s`` of
    ``idle(s) / makespan``, where ``idle(s) = makespan - busy[s]`` (a stage that finishes early idles
    until the last one is done: the batch ends for all stages together)."""

    spans: tuple[tuple[tuple[float, float, PipeInstruction], ...], ...]
    makespan: float
    busy: tuple[float, ...]

    def idle(self, stage: int) -> float:
        return self.makespan - self.busy[stage]

    @property
    def bubble_fraction(self) -> float:
        if not self.makespan:
            return 0.0
        return sum(self.idle(s) for s in range(len(self.busy))) / (len(self.busy) * self.makespan)


class _Message:
    __slots__ = ("done", "micro_batch", "sent")

    def __init__(self, micro_batch: int, sent: float):
        self.micro_batch, self.sent, self.done = micro_batch, sent, None


def _channel(instruction: PipeInstruction, stage: int, stages: int, chunks: int) -> tuple[str, int]:
    """``(kind, boundary)``: the boundary is the virtual stage that sends across it."""
    if not 0 <= instruction.chunk < chunks:
        raise ValueError(f"simulate: {instruction!r} on stage {stage} names chunk {instruction.chunk}, "
                         f"but there are chunks 0..{chunks - 1}")
    virtual, last = instruction.chunk * stages + stage, stages * chunks - 1
    sender = {SendActivation: virtual, RecvActivation: virtual - 1, SendGrad: virtual, RecvGrad: virtual + 1}
    boundary = sender[type(instruction)]
    if not 0 <= boundary <= last or (isinstance(instruction, SendActivation) and virtual == last) or (
            isinstance(instruction, SendGrad) and virtual == 0):
        raise ValueError(f"simulate: {instruction!r} on stage {stage} (virtual stage {virtual}) has no peer: "
                         f"virtual stages are 0..{last}")
    kind = "activation" if isinstance(instruction, (SendActivation, RecvActivation)) else "grad"
    return kind, boundary


def simulate(streams: list[list[PipeInstruction]], *, chunks: int = 1, costs: dict | None = None,
             blocking_sends: bool = False) -> Timeline:
    """Run ``streams`` (``streams[s]``: stage ``s``'s flattened instructions) and time them.

    ``costs`` maps ``"F"``, ``"B"``, ``"Bi"``, ``"W"`` to a pass's duration (defaults
    ``{"F": 1, "B": 2, "Bi": 1, "W": 1}``; keys not given keep their default)."""
    if not streams:
        raise ValueError("simulate: give at least one stream (one per stage), got none")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"simulate: chunks must be an integer >= 1, got {chunks!r}")
    unknown = sorted(set(costs or {}) - set(DEFAULT_COSTS))
    if unknown:
        raise ValueError(f"simulate: costs keys must be among {sorted(DEFAULT_COSTS)}, got {unknown}")
    cost = {**DEFAULT_COSTS, **(costs or {})}
    if any(isinstance(c, bool) or not isinstance(c, int | float) or c < 0 for c in cost.values()):
        raise ValueError(f"simulate: costs must be numbers >= 0, got {cost}")

    stages = len(streams)
    pc, clock = [0] * stages, [0] * stages
    spans: list[list] = [[] for _ in streams]
    messages: dict[tuple, list[_Message]] = defaultdict(list)
    received: dict[tuple, int] = defaultdict(int)
    posted: list[_Message | None] = [None] * stages  # a blocking send waiting for its receive

    def advance(s: int) -> bool:
        """Run stage s's next instruction if it can; say whether anything changed."""
        instruction = streams[s][pc[s]]
        if type(instruction) in _COST_KEY:
            duration = cost[_COST_KEY[type(instruction)]]
            spans[s].append((clock[s], clock[s] + duration, instruction))
            clock[s] += duration
        elif isinstance(instruction, (SendActivation, SendGrad)):
            if posted[s] is None:
                posted[s] = _Message(instruction.micro_batch, clock[s])
                messages[_channel(instruction, s, stages, chunks)].append(posted[s])
                if blocking_sends:
                    return True
            if blocking_sends and posted[s].done is None:
                return False
            clock[s] = posted[s].done if blocking_sends else clock[s]
            posted[s] = None
        elif isinstance(instruction, (RecvActivation, RecvGrad)):
            channel = _channel(instruction, s, stages, chunks)
            queue, index = messages[channel], received[channel]
            if index >= len(queue):
                return False
            message = queue[index]
            if message.micro_batch != instruction.micro_batch:
                raise RuntimeError(f"message order: stage {s} waits at {instruction!r} but the next {channel[0]} "
                                   f"message from virtual stage {channel[1]} is for micro-batch {message.micro_batch}")
            message.done = clock[s] = max(clock[s], message.sent)
            received[channel] += 1
        elif not isinstance(instruction, (LoadMicroBatch, *_END)):
            raise ValueError(f"simulate: stage {s} has {instruction!r}, which is not a pipeline instruction")
        pc[s] += 1
        return True

    moved = True
    while moved:
        moved = False
        for s in range(stages):
            while pc[s] < len(streams[s]) and advance(s):
                moved = True
    stuck = [f"stage {s} waits at {streams[s][pc[s]]!r}" for s in range(stages) if pc[s] < len(streams[s])]
    if stuck:
        raise RuntimeError("deadlock: " + ", ".join(stuck))
    busy = tuple(sum(end - start for start, end, _ in stage) for stage in spans)
    makespan = max((stage[-1][1] for stage in spans if stage), default=0)
    return Timeline(tuple(tuple(stage) for stage in spans), makespan, busy)


def check(streams: list[list[PipeInstruction]], *, chunks: int = 1, max_buffers: list[int] | None = None) -> list[int]:
    """Verify that ``streams`` run one pipeline batch correctly; return each stage's peak of held activations.

    Per stage and chunk: every micro-batch ``0..m-1`` is forwarded exactly once; in a training batch
    (any backward present) backwarded exactly once, by ``BackwardPass`` or by ``BackwardInput`` then
    ``BackwardWeight``, after its forward. Loads sit on the first and last virtual stage before the
    forward; each receive and send sits where a peer exists, once, on the right side of its pass; the
    micro-batch order of every boundary's sends equals its receives'; training streams end with
    ``ReduceTiedGrads, ReduceGrads, OptimizerStep``, inference streams have none. A micro-batch is held
    from its forward until its backward (its weight pass when split); with ``max_buffers`` no stage
    ``s`` may hold more than ``max_buffers[s]``. Finally the streams must run with blocking sends.
    Raises ValueError naming the first violation (RuntimeError from `simulate` on a deadlock)."""
    forwards = [i.micro_batch for stream in streams for i in stream if isinstance(i, ForwardPass)]
    if not forwards:
        raise ValueError("check: the streams forward no micro-batch")
    micro_batches = 1 + max(forwards)
    train = any(isinstance(i, (BackwardPass, BackwardInput, BackwardWeight, *_END)) for st in streams for i in st)
    orders: dict[tuple, list[int]] = defaultdict(list)  # (channel, is_send) -> micro-batches in order
    peaks = [_check_stage(stream, s, len(streams), chunks, micro_batches, train, orders)
             for s, stream in enumerate(streams)]
    for s, peak in enumerate(peaks):
        if max_buffers is not None and peak > max_buffers[s]:
            raise ValueError(f"check: stage {s} holds {peak} micro-batches' activations at once, more than its "
                             f"{max_buffers[s]} buffers")
    for channel in {channel for channel, _ in orders}:
        if orders[channel, True] != orders[channel, False]:
            raise ValueError(f"check: {channel[0]} messages from virtual stage {channel[1]} are sent in micro-batch "
                             f"order {orders[channel, True]} but received in order {orders[channel, False]}")
    simulate(streams, chunks=chunks, blocking_sends=True)
    return peaks


def _check_stage(stream: list[PipeInstruction], s: int, stages: int, chunks: int, micro_batches: int, train: bool,
                 orders: dict[tuple, list[int]]) -> int:
    """`check` for stage ``s``'s stream; records its messages' order in ``orders``; returns its peak."""

    def fail(message: str) -> None:
        raise ValueError(f"check: stage {s}: {message}")

    body = [i for i in stream if not isinstance(i, _END)]
    if [type(i) for i in stream[len(body):]] != ([*_END] if train else []) or len(stream) - len(body) != (
            3 if train else 0):
        fail(f"must end with {'ReduceTiedGrads, ReduceGrads, OptimizerStep' if train else 'no reduction'}, got "
             f"{[i for i in stream if isinstance(i, _END)]} at the end of {len(stream)} instructions")
    where: dict[tuple, list[int]] = defaultdict(list)  # (type, micro_batch, chunk) -> indices in the stream
    held = peak = 0
    for index, i in enumerate(body):
        if not (0 <= i.micro_batch < micro_batches and 0 <= i.chunk < chunks):
            fail(f"{i!r} is outside the batch: micro-batches 0..{micro_batches - 1}, chunks 0..{chunks - 1}")
        where[type(i), i.micro_batch, i.chunk].append(index)
        if isinstance(i, (SendActivation, RecvActivation, SendGrad, RecvGrad)):
            orders[_channel(i, s, stages, chunks), isinstance(i, (SendActivation, SendGrad))].append(i.micro_batch)
        held += isinstance(i, ForwardPass) - isinstance(i, BackwardPass | BackwardWeight)
        peak = max(peak, held)
    last = stages * chunks - 1
    for m in range(micro_batches):
        for c in range(chunks):
            virtual = c * stages + s
            forward, full, split, weight = (where[kind, m, c] for kind in _COST_KEY)
            if len(forward) != 1:
                fail(f"forwards micro-batch {m} chunk {c} {len(forward)} times, not once")
            expected = {LoadMicroBatch: virtual in (0, last), RecvActivation: virtual > 0,
                        SendActivation: virtual < last, RecvGrad: train and virtual < last,
                        SendGrad: train and virtual > 0}
            for kind, wanted in expected.items():
                if len(where[kind, m, c]) != wanted:
                    fail(f"has {len(where[kind, m, c])} {kind.__name__} for micro-batch {m} chunk {c}, "
                         f"expected {int(wanted)}")
            if not train and (full or split or weight):
                fail(f"an inference stream backwards micro-batch {m}")
            backward = full or split
            if train and not ((len(full), len(split), len(weight)) in ((1, 0, 0), (0, 1, 1))
                              and forward[0] < backward[0] and (not weight or split[0] < weight[0])):
                fail(f"micro-batch {m} chunk {c} must be backwarded once after its forward (BackwardPass, or "
                     f"BackwardInput then BackwardWeight), got {len(full)} B, {len(split)} Bi, {len(weight)} W")
            if max(where[LoadMicroBatch, m, c] + where[RecvActivation, m, c], default=-1) > forward[0] or min(
                    where[SendActivation, m, c], default=forward[0]) < forward[0]:
                fail(f"the load and receive of micro-batch {m} chunk {c} must precede its forward, its send follow it")
            if train and (max(where[RecvGrad, m, c], default=-1) > backward[0]
                          or min(where[SendGrad, m, c], default=backward[0]) < backward[0]):
                fail(f"RecvGrad of micro-batch {m} chunk {c} must precede its backward, SendGrad follow it")
    return peak
