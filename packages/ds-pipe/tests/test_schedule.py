"""Schedules as instruction streams: structure, memory, messages, deadlock-freedom, bubbles, drawing.

Every expected value is an independent reference: a closed form from the literature (the bubbles of
1F1B, Megatron's interleaved 1F1B and ZB-H1), an order or a table written out by hand from a schedule's
definition, or an error message written out. Pure Python, no processes: the whole file runs in seconds.
"""

from __future__ import annotations

import dataclasses

import pytest

from ds_pipe._simulate import Timeline, check, simulate
from ds_pipe.schedule import (
    BackwardInput,
    BackwardPass,
    BackwardWeight,
    ForwardPass,
    InferenceSchedule,
    InterleavedSchedule,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
    ZeroBubbleSchedule,
    print_schedule,
)

COMPUTE = (ForwardPass, BackwardPass, BackwardInput, BackwardWeight)
PIPES = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8, 16)]
# interleaved: m >= p and a multiple of p
INTERLEAVED = [(p, m, v) for p in (2, 3, 4) for m in sorted({p, 2 * p, 4 * p, 16}) if m % p == 0 for v in (1, 2, 3)]


def streams(cls, p: int, m: int, **kwargs) -> list[list]:
    return [list(cls(m, p, s, **kwargs).instructions()) for s in range(p)]


def passes(stream) -> list[str]:
    return [repr(i) for i in stream if isinstance(i, COMPUTE)]


# -- instructions ---------------------------------------------------------------------------------


def test_instruction_labels():
    labels = [LoadMicroBatch(3), ForwardPass(3), BackwardPass(3), BackwardInput(3), BackwardWeight(3),
              SendActivation(3), RecvActivation(3), SendGrad(3), RecvGrad(3), ForwardPass(3, chunk=1), SendGrad(0, 2)]
    assert [repr(i) for i in labels] == ["L3", "F3", "B3", "Bi3", "W3", "SA3", "RA3", "SG3", "RG3", "F3.c1", "SG0.c2"]
    assert str(ForwardPass(3, 1)) == "F3.c1"
    assert [repr(i) for i in (ReduceTiedGrads(), ReduceGrads(), OptimizerStep())] == [
        "ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]


def test_instructions_are_frozen_values():
    assert ForwardPass(2, 1) == ForwardPass(micro_batch=2, chunk=1)
    assert ForwardPass(2) != BackwardPass(2) and ForwardPass(2) != ForwardPass(2, 1)
    assert len({ForwardPass(2), ForwardPass(2), BackwardPass(2), ReduceGrads(), ReduceGrads()}) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        ForwardPass(2).micro_batch = 3


# -- 1F1B -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), PIPES)
def test_1f1b_is_a_valid_batch_within_its_buffers(p, m):
    schedules = [TrainSchedule(m, p, s) for s in range(p)]
    peaks = check([list(x.instructions()) for x in schedules], max_buffers=[x.num_pipe_buffers() for x in schedules])
    assert peaks == [min(p - s, m) for s in range(p)]  # 1F1B: stage s holds p - s micro-batches
    for s, stream in enumerate(streams(TrainSchedule, p, m)):
        kinds = [type(i) for i in stream if isinstance(i, COMPUTE)]
        # warmup of min(p - s - 1, m) forwards, then the first steady forward, then the first backward
        assert kinds.index(BackwardPass) == min(p - s, m)
        assert stream[-3:] == [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


@pytest.mark.parametrize(("p", "m"), PIPES)
def test_1f1b_bubble_is_the_closed_form(p, m):
    timeline = simulate(streams(TrainSchedule, p, m), costs={"F": 1, "B": 2})
    assert timeline.makespan == 3 * (m + p - 1)
    assert timeline.busy == (3 * m,) * p
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    for f, b in ((1, 1), (2, 3), (3, 1)):  # the same (m + p - 1)(F + B) at any cost ratio
        assert simulate(streams(TrainSchedule, p, m), costs={"F": f, "B": b}).makespan == (m + p - 1) * (f + b)


def test_1f1b_order_by_hand():
    # p=3, m=4: stage 0 warms up with 2 forwards, stage 1 with 1, stage 2 with none
    assert [passes(x) for x in streams(TrainSchedule, 3, 4)] == [
        ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"],
        ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
        ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"],
    ]
    first, middle, last = streams(TrainSchedule, 3, 4)
    # the middle stage receives before and sends after each pass, and loads nothing
    assert middle.index(RecvActivation(0)) < middle.index(ForwardPass(0)) < middle.index(SendActivation(0))
    assert middle.index(RecvGrad(0)) < middle.index(BackwardPass(0)) < middle.index(SendGrad(0))
    assert not any(isinstance(i, LoadMicroBatch) for i in middle)
    # the first stage loads inputs, the last loads labels; neither talks past the ends of the pipe
    assert first[:2] == [LoadMicroBatch(0), ForwardPass(0)] and LoadMicroBatch(0) in last
    assert not any(isinstance(i, (RecvActivation, SendGrad)) for i in first)
    assert not any(isinstance(i, (SendActivation, RecvGrad)) for i in last)


# -- inference ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), PIPES)
def test_inference_forwards_only_with_the_fill_bubble(p, m):
    batch = streams(InferenceSchedule, p, m)
    check(batch)
    for s, stream in enumerate(batch):
        assert not any(isinstance(i, (BackwardPass, BackwardInput, BackwardWeight, RecvGrad, SendGrad,
                                      ReduceTiedGrads, ReduceGrads, OptimizerStep)) for i in stream)
        assert passes(stream) == [f"F{k}" for k in range(m)]
        assert InferenceSchedule(m, p, s).num_pipe_buffers() == 2
    timeline = simulate(batch, costs={"F": 1})
    assert timeline.makespan == m + p - 1
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


# -- interleaved ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m", "v"), INTERLEAVED)
def test_interleaved_is_a_valid_batch_within_its_buffers(p, m, v):
    schedules = [InterleavedSchedule(m, p, s, chunks=v) for s in range(p)]
    peaks = check([list(x.instructions()) for x in schedules], chunks=v,
                  max_buffers=[x.num_pipe_buffers() for x in schedules])
    assert peaks == [x.num_pipe_buffers() for x in schedules]


def test_interleaved_buffers_by_hand():
    # Megatron's warmup 2(p - s - 1) + (v - 1)p, plus the first steady forward: p=4, v=2 -> 11, 9, 7, 5
    assert check(streams(InterleavedSchedule, 4, 8, chunks=2), chunks=2) == [11, 9, 7, 5]
    # m = p = 4: stage 0's warmup (10) is capped at all m*v = 8 forwards
    assert check(streams(InterleavedSchedule, 4, 4, chunks=2), chunks=2) == [8, 8, 7, 5]


@pytest.mark.parametrize(("p", "m", "v"), INTERLEAVED)
def test_interleaved_bubble_is_the_closed_form(p, m, v):
    # Per chunk F = 1, B = 2, i.e. a v-th of a whole stage's F = v, B = 2v: the stage works 3vm and the
    # bubble is Megatron's (p - 1)/(vm + p - 1). It holds exactly for every (p, m, v) here, m = p
    # included (where the first stages' warmup is capped at all m*v forwards). Megatron's warmup,
    # 2(p - s - 1) + (v - 1)p, is p - s - 1 forwards longer than messages taking no time need (they let
    # its p2p overlap compute): here they cost memory (see num_pipe_buffers), not time.
    timeline = simulate(streams(InterleavedSchedule, p, m, chunks=v), chunks=v, costs={"F": 1, "B": 2})
    assert timeline.makespan == 3 * (v * m + p - 1)
    assert timeline.busy == (3 * v * m,) * p
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


def test_interleaved_order_by_hand():
    # p=2, m=4, v=2: forwards in groups of p=2 micro-batches, chunk 0 then chunk 1; backwards the same
    # with the chunks reversed. Stage 0 warms up with 2*1 + 1*2 = 4 forwards, stage 1 with 0 + 2 = 2.
    assert [passes(x) for x in streams(InterleavedSchedule, 2, 4, chunks=2)] == [
        ["F0", "F1", "F0.c1", "F1.c1", "F2", "B0.c1", "F3", "B1.c1", "F2.c1", "B0", "F3.c1", "B1",
         "B2.c1", "B3.c1", "B2", "B3"],
        ["F0", "F1", "F0.c1", "B0.c1", "F1.c1", "B1.c1", "F2", "B0", "F3", "B1", "F2.c1", "B2.c1",
         "F3.c1", "B3.c1", "B2", "B3"],
    ]
    stage0, stage1 = streams(InterleavedSchedule, 2, 4, chunks=2)
    # virtual stage 2 (stage 0, chunk 1) takes its input from virtual stage 1 (stage 1, chunk 0);
    # the labels are loaded on virtual stage 3 (stage 1, chunk 1)
    assert stage0.index(RecvActivation(0, 1)) < stage0.index(ForwardPass(0, 1))
    assert RecvActivation(0, 0) not in stage0 and SendActivation(0, 1) in stage0 and SendGrad(0, 1) in stage0
    assert LoadMicroBatch(0, 1) in stage1 and SendActivation(0, 1) not in stage1 and RecvGrad(0, 1) not in stage1


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in PIPES if m >= p and m % p == 0])
def test_interleaved_with_one_chunk_is_1f1b(p, m):
    for s in range(p):
        one = InterleavedSchedule(m, p, s, chunks=1)
        assert list(one) == list(TrainSchedule(m, p, s))
        assert one.num_pipe_buffers() == TrainSchedule(m, p, s).num_pipe_buffers()


# -- zero bubble ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), PIPES)
def test_zero_bubble_is_a_valid_batch_within_1f1b_peak(p, m):
    batch = streams(ZeroBubbleSchedule, p, m)
    # held from F to W: every stage holds what 1F1B's stage 0 does, min(p, m) (ZB-H1's memory claim)
    assert check(batch, max_buffers=[min(p, m)] * p) == [min(p, m)] * p
    assert all(ZeroBubbleSchedule(m, p, s).num_pipe_buffers() == min(p, m) for s in range(p))
    for s, stream in enumerate(batch):
        assert not any(isinstance(i, BackwardPass) for i in stream)
        waiting = peak = 0  # forwarded, input backward not yet run: the paper's (p - s) full activations
        for i in stream:
            waiting += isinstance(i, ForwardPass) - isinstance(i, BackwardInput)
            peak = max(peak, waiting)
        assert peak == min(p - s, m)
        # a micro-batch's input gradient goes upstream before its weight pass runs
        if s > 0:
            assert all(stream.index(SendGrad(k)) < stream.index(BackwardWeight(k)) for k in range(m))


def test_zero_bubble_order_by_hand():
    # p=2, m=4: 1F1B with Bi for B; stage s runs W(k - s) right after Bi(k), the rest at the end
    assert [passes(x) for x in streams(ZeroBubbleSchedule, 2, 4)] == [
        ["F0", "F1", "Bi0", "W0", "F2", "Bi1", "W1", "F3", "Bi2", "W2", "Bi3", "W3"],
        ["F0", "Bi0", "F1", "Bi1", "W0", "F2", "Bi2", "W1", "F3", "Bi3", "W2", "W3"],
    ]


@pytest.mark.parametrize(("p", "m"), PIPES)
def test_zero_bubble_bubble_is_a_third_of_1f1b(p, m):
    zb = simulate(streams(ZeroBubbleSchedule, p, m), costs={"F": 1, "Bi": 1, "W": 1})
    one_f_one_b = simulate(streams(TrainSchedule, p, m), costs={"F": 1, "B": 2})
    assert zb.busy == one_f_one_b.busy == (3 * m,) * p
    if m >= p:
        # ZB-H1 (Qi et al. 2023, section 2.1): bubble (p - 1)(T_F + T_B - T_W) = p - 1, against 1F1B's
        # (p - 1)(T_F + T_B + T_W) = 3(p - 1): makespans 3m + p - 1 and 3m + 3(p - 1)
        assert zb.makespan == 3 * m + p - 1
        assert 3 * (zb.makespan - 3 * m) == one_f_one_b.makespan - 3 * m
    else:  # too few micro-batches to fill the pipe: no closed form asserted, but never worse than 1F1B
        assert zb.makespan <= one_f_one_b.makespan


# -- every schedule -------------------------------------------------------------------------------


def every_schedule():
    for p, m in PIPES:
        yield TrainSchedule, p, m, {}
        yield InferenceSchedule, p, m, {}
        yield ZeroBubbleSchedule, p, m, {}
    for p, m, v in INTERLEAVED:
        yield InterleavedSchedule, p, m, {"chunks": v}


def test_steps_are_deepspeed_shaped():
    for cls, p, m, kwargs in every_schedule():
        for s in range(p):
            schedule = cls(m, p, s, **kwargs)
            steps = list(schedule.steps())
            assert [i for step in steps for i in step] == list(schedule.instructions())
            assert list(schedule) == steps  # iterating gives the steps, as DeepSpeed's schedules do
            assert all(isinstance(step, list) and sum(isinstance(i, COMPUTE) for i in step) <= 1 for step in steps)
            assert (schedule.micro_batches, schedule.stages, schedule.stage_id) == (m, p, s)
            if cls is not InferenceSchedule:
                assert steps[-1] == [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


def test_no_deadlock_with_blocking_sends_at_any_costs():
    # check() already runs each batch with blocking sends; a rendezvous deadlock does not depend on the
    # costs, so these must all finish too, and with blocking sends a schedule can only get slower
    for cls, p, m, kwargs in every_schedule():
        chunks = kwargs.get("chunks", 1)
        batch = streams(cls, p, m, **kwargs)
        for costs in ({"F": 1, "B": 2}, {"F": 3, "B": 1, "Bi": 2, "W": 5}):
            buffered = simulate(batch, chunks=chunks, costs=costs)
            assert simulate(batch, chunks=chunks, costs=costs, blocking_sends=True).makespan >= buffered.makespan


# -- print_schedule -------------------------------------------------------------------------------


def test_print_schedule_1f1b_by_hand():
    # p=2, m=4, every pass one slot: stage 0 warms up with one forward and waits a slot for B0's
    # gradient; stage 1 alternates from its first forward; stage 0 waits again for B3's gradient
    expected = ("stage 0 | F0 F1 .  B0 F2 B1 F3 B2 .  B3\n"
                "stage 1 | .  F0 B0 F1 B1 F2 B2 F3 B3 .")
    assert print_schedule(TrainSchedule, 2, 4) == expected


def test_print_schedule_zero_bubble_by_hand():
    # p=2, m=2: stage 1 runs F0 Bi0 F1 Bi1 then both weight passes; stage 0 fills its waits with W0
    expected = ("stage 0 | F0  F1  .   Bi0 W0  Bi1 W1\n"
                "stage 1 | .   F0  Bi0 F1  Bi1 W0  W1")
    assert print_schedule(ZeroBubbleSchedule, 2, 2) == expected


def test_print_schedule_interleaved_shows_chunks():
    table = print_schedule(InterleavedSchedule, 2, 2, chunks=2).splitlines()
    assert len(table) == 2 and table[0].split("|")[1].split()[:4] == ["F0", "F1", "F0.c1", "F1.c1"]


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("make", "message"), [
    (lambda: TrainSchedule(0, 2, 0), "TrainSchedule: micro_batches must be an integer >= 1, got 0"),
    (lambda: TrainSchedule(4.0, 2, 0), "TrainSchedule: micro_batches must be an integer >= 1, got 4.0"),
    (lambda: InferenceSchedule(4, 0, 0), "InferenceSchedule: stages must be an integer >= 1, got 0"),
    (lambda: ZeroBubbleSchedule(4, True, 0), "ZeroBubbleSchedule: stages must be an integer >= 1, got True"),
    (lambda: TrainSchedule(4, 2, -1), "TrainSchedule: stage_id must be an integer >= 0, got -1"),
    (lambda: TrainSchedule(4, 2, 2), "TrainSchedule: stage_id must be in 0..1 (stages=2), got 2"),
    (lambda: InterleavedSchedule(2, 4, 0), "InterleavedSchedule: micro_batches must be >= stages, got "
                                           "micro_batches=2 < stages=4"),
    (lambda: InterleavedSchedule(6, 4, 0), "InterleavedSchedule: micro_batches must be a multiple of stages=4 "
                                           "(micro-batches go through the chunks in groups of 4), got micro_batches=6"),
    (lambda: InterleavedSchedule(4, 2, 0, chunks=0), "InterleavedSchedule: chunks must be an integer >= 1, got 0"),
    (lambda: InterleavedSchedule(4, 1, 0, chunks=2), "InterleavedSchedule: chunks > 1 needs stages >= 2 (with one "
                                                     "stage every chunk is on the same rank, nothing to interleave), "
                                                     "got stages=1, chunks=2"),
    (lambda: simulate([]), "simulate: give at least one stream (one per stage), got none"),
    (lambda: simulate([[]], chunks=0), "simulate: chunks must be an integer >= 1, got 0"),
    (lambda: simulate([[]], costs={"X": 1}), "simulate: costs keys must be among ['B', 'Bi', 'F', 'W'], got ['X']"),
    (lambda: simulate([[]], costs={"F": -1}), "simulate: costs must be numbers >= 0, got"),
    (lambda: simulate([[SendActivation(0)]]), "simulate: SA0 on stage 0 (virtual stage 0) has no peer: virtual "
                                              "stages are 0..0"),
    (lambda: simulate([[RecvGrad(0, 2)], []], chunks=2), "simulate: RG0.c2 on stage 0 names chunk 2, but there "
                                                         "are chunks 0..1"),
    (lambda: simulate([["F0"]]), "simulate: stage 0 has 'F0', which is not a pipeline instruction"),
])
def test_bad_input_is_named(make, message):
    with pytest.raises(ValueError) as error:
        make()
    assert str(error.value).startswith(message)


# -- the simulator itself, on hand-timed streams --------------------------------------------------


def test_simulate_times_by_hand():
    stage0 = [LoadMicroBatch(0), ForwardPass(0), SendActivation(0), ForwardPass(1)]
    stage1 = [BackwardWeight(7), BackwardWeight(8), RecvActivation(0), ForwardPass(0)]
    costs = {"F": 1, "W": 3}
    buffered = simulate([stage0, stage1], costs=costs)
    assert buffered.spans == (
        ((0, 1, ForwardPass(0)), (1, 2, ForwardPass(1))),
        ((0, 3, BackwardWeight(7)), (3, 6, BackwardWeight(8)), (6, 7, ForwardPass(0))),
    )
    assert (buffered.makespan, buffered.busy) == (7, (2, 7))
    assert buffered.idle(0) == 5 and buffered.bubble_fraction == pytest.approx((5 / 7 + 0) / 2)
    # a blocking send waits for its receive, reached at 6: stage 0's second forward starts then
    blocking = simulate([stage0, stage1], costs=costs, blocking_sends=True)
    assert blocking.spans[0] == ((0, 1, ForwardPass(0)), (6, 7, ForwardPass(1)))
    assert blocking.makespan == 7 and isinstance(blocking, Timeline)


def test_simulate_names_a_deadlock():
    with pytest.raises(RuntimeError, match=r"^deadlock: stage 0 waits at RG0, stage 1 waits at RA0$"):
        simulate([[RecvGrad(0), ForwardPass(0), SendActivation(0)], [RecvActivation(0), SendGrad(0)]])
    crossed = [[SendActivation(0), RecvGrad(0)], [SendGrad(0), RecvActivation(0)]]
    simulate(crossed)  # buffered sends: fine
    with pytest.raises(RuntimeError, match=r"^deadlock: stage 0 waits at SA0, stage 1 waits at SG0$"):
        simulate(crossed, blocking_sends=True)


def test_simulate_matches_messages_in_order():
    with pytest.raises(RuntimeError, match="stage 1 waits at RA1 but the next activation message from virtual "
                                           "stage 0 is for micro-batch 0"):
        simulate([[SendActivation(0), SendActivation(1)], [RecvActivation(1), RecvActivation(0)]])


# -- check catches broken streams -----------------------------------------------------------------


def receive_grad_1_before_grad_0(batch):  # still before B1, so only the message order breaks
    batch[0].remove(RecvGrad(1))
    batch[0].insert(batch[0].index(RecvGrad(0)), RecvGrad(1))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda b: b[1].remove(BackwardPass(2)), "check: stage 1: micro-batch 2 chunk 0 must be backwarded once after "
                                             "its forward (BackwardPass, or BackwardInput then BackwardWeight), got "
                                             "0 B, 0 Bi, 0 W"),
    (lambda b: b[0].insert(0, ForwardPass(1)), "check: stage 0: forwards micro-batch 1 chunk 0 2 times, not once"),
    (lambda b: b[1].remove(RecvActivation(3)), "check: stage 1: has 0 RecvActivation for micro-batch 3 chunk 0, "
                                               "expected 1"),
    (lambda b: b[1].pop(), "check: stage 1: must end with ReduceTiedGrads, ReduceGrads, OptimizerStep"),
    (lambda b: b[0].insert(0, SendActivation(0)), "check: stage 0: has 2 SendActivation for micro-batch 0"),
    (receive_grad_1_before_grad_0, "check: grad messages from virtual stage 1 are sent in micro-batch order "
                                   "[0, 1, 2, 3] but received in order [1, 0, 2, 3]"),
    (lambda b: b[1].insert(0, ForwardPass(0, 1)), "check: stage 1: F0.c1 is outside the batch: micro-batches "
                                                  "0..3, chunks 0..0"),
])
def test_check_catches(edit, message):
    batch = streams(TrainSchedule, 2, 4)
    edit(batch)
    with pytest.raises(ValueError) as error:
        check(batch)
    assert str(error.value).startswith(message)


def test_check_catches_memory_and_split_order():
    with pytest.raises(ValueError, match=r"check: stage 0 holds 2 micro-batches' activations at once, more than "
                                         r"its 1 buffers"):
        check(streams(TrainSchedule, 2, 4), max_buffers=[1, 1])
    batch = streams(ZeroBubbleSchedule, 2, 2)
    weight = batch[1].index(BackwardWeight(0))
    batch[1].insert(batch[1].index(BackwardInput(0)), batch[1].pop(weight))  # W0 before its Bi0
    with pytest.raises(ValueError, match="check: stage 1: micro-batch 0 chunk 0 must be backwarded once"):
        check(batch)
