"""The schedules as DeepSpeed's own tests use them (deepspeed/runtime/pipe/schedule.py): the
``num_micro_batches``/``stage``/``num_stages``/``is_first_stage``/``is_last_stage`` properties, iterating a
schedule gives one list of instructions per step (``for cmds in sched``, ``list(iter(sched))``), and
DeepSpeed's ``DataParallelSchedule``. Where ds-pipe's steps differ (no empty steps, instructions naming
micro-batches rather than buffers) the README's table says so."""

from __future__ import annotations

import pytest

import ds_pipe
from ds_pipe import schedule


def _count(cmds, cls) -> int:
    return sum(type(c) is cls for c in cmds)


@pytest.mark.parametrize("cls", [schedule.TrainSchedule, schedule.InferenceSchedule, schedule.ZeroBubbleSchedule])
def test_properties_are_deepspeeds(cls):
    for stage_id in range(3):
        sched = cls(micro_batches=4, stages=3, stage_id=stage_id)
        assert (sched.num_micro_batches, sched.num_stages, sched.stage, sched.stages) == (4, 3, stage_id, 3)
        assert sched.is_first_stage == (stage_id == 0) and sched.is_last_stage == (stage_id == 2)
        assert (sched.prev_stage, sched.next_stage) == (stage_id - 1, stage_id + 1)
        with pytest.raises(AttributeError):
            sched.num_micro_batches = 5  # a read-only view, as DeepSpeed's property


def test_iterating_gives_one_list_per_step():
    sched = schedule.TrainSchedule(micro_batches=4, stages=1, stage_id=0)
    full = list(iter(sched))
    assert full == list(sched.steps()) and all(isinstance(cmds, list) for cmds in full)
    assert list(sched) == full  # iterable again, as DeepSpeed's (its __iter__ restarts)
    # one stage: load + forward, then the backward; the last step also reduces and steps
    assert len(full) == 2 * sched.num_micro_batches + 1
    for idx, cmds in enumerate(full[:-1]):
        if idx % 2 == 0:
            assert [type(c) for c in cmds] == [schedule.LoadMicroBatch, schedule.ForwardPass]
            assert cmds[0].micro_batch == cmds[1].micro_batch
        else:
            assert [type(c) for c in cmds] == [schedule.BackwardPass]
    assert full[-1] == [schedule.ReduceTiedGrads(), schedule.ReduceGrads(), schedule.OptimizerStep()]
    flat = list(sched.instructions())
    assert flat == [c for cmds in full for c in cmds]


@pytest.mark.parametrize("micro_batches", [1, 3, 8])
def test_deepspeed_stage_checks_hold(micro_batches, stages=3):
    first = schedule.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=0)
    for cmds in first:  # DeepSpeed's test_pipe_schedule_firststage
        assert not any(isinstance(c, (schedule.SendGrad, schedule.RecvActivation)) for c in cmds)
    last = schedule.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stages - 1)
    for cmds in last:  # ... and test_pipe_schedule_laststage
        assert not any(isinstance(c, (schedule.SendActivation, schedule.RecvGrad)) for c in cmds)
    for stage_id in range(stages):  # inference: every micro-batch forwarded once, loads on the end stages
        cmds = [c for step in schedule.InferenceSchedule(micro_batches, stages, stage_id) for c in step]
        assert _count(cmds, schedule.ForwardPass) == micro_batches
        assert _count(cmds, schedule.LoadMicroBatch) == (micro_batches if stage_id in (0, stages - 1) else 0)
        assert _count(cmds, schedule.RecvActivation) == (micro_batches if stage_id > 0 else 0)
        assert _count(cmds, schedule.SendActivation) == (micro_batches if stage_id < stages - 1 else 0)


def test_data_parallel_schedule_is_deepspeeds_example():
    sched = ds_pipe.DataParallelSchedule(micro_batches=3, stages=1, stage_id=0)
    steps = list(sched)
    assert steps == [
        [schedule.LoadMicroBatch(0), schedule.ForwardPass(0), schedule.BackwardPass(0)],
        [schedule.LoadMicroBatch(1), schedule.ForwardPass(1), schedule.BackwardPass(1)],
        [schedule.LoadMicroBatch(2), schedule.ForwardPass(2), schedule.BackwardPass(2), schedule.ReduceGrads(),
         schedule.OptimizerStep()],
    ]
    assert sched.num_pipe_buffers() == 1 and sched.is_first_stage and sched.is_last_stage
    with pytest.raises(ValueError, match=r"stages must be 1 .*got 2"):
        ds_pipe.DataParallelSchedule(micro_batches=3, stages=2, stage_id=0)


def test_a_peer_failure_survives_pickling_with_its_source_rank():
    import pickle

    from ds_pipe._p2p import PeerFailed

    again = pickle.loads(pickle.dumps(PeerFailed("rank 1 failed: boom", source=1)))
    assert type(again) is PeerFailed and str(again) == "rank 1 failed: boom" and again.source == 1
