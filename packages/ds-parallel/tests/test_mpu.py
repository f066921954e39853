"""ModelParallelUnit on 4 ranks: every group's rank list against an arithmetic reference of the layout
(rank = ((pipe * D + data) * S + sequence) * T + tensor), the groups really connect those ranks, and bad sizes
are named."""

import pytest
import torch
import torch.distributed as dist

import ds_comm
from ds_comm import PipeModelDataParallelTopology
from ds_comm.testing import spawn
from ds_parallel import ModelParallelUnit


def reference(rank, world, tp, pp, sp):
    """What each question should answer for ``rank``, by arithmetic alone."""
    dp = world // (tp * pp * sp)
    t, rest = rank % tp, rank // tp
    s, rest = rest % sp, rest // sp
    d, p = rest % dp, rest // dp

    def at(p_, d_, s_, t_):
        return ((p_ * dp + d_) * sp + s_) * tp + t_

    return {
        "tensor": (t, [at(p, d, s, i) for i in range(tp)]),
        "data": (d, [at(p, i, s, t) for i in range(dp)]),
        "sequence": (s, [at(p, d, i, t) for i in range(sp)]),
        "pipe": (p, [at(i, d, s, t) for i in range(pp)]),
        "sequence_data": (d * sp + s, sorted(at(p, i, j, t) for i in range(dp) for j in range(sp))),
    }


QUESTIONS = {  # our axis -> the mpu methods that must answer it (rank, world size, group)
    "tensor": [("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size",
                "get_tensor_model_parallel_group"),
               ("get_model_parallel_rank", "get_model_parallel_world_size", "get_model_parallel_group"),
               ("get_slice_parallel_rank", "get_slice_parallel_world_size", "get_slice_parallel_group")],
    "data": [("get_data_parallel_rank", "get_data_parallel_world_size", "get_data_parallel_group")],
    "sequence": [("get_sequence_parallel_rank", "get_sequence_parallel_world_size", "get_sequence_parallel_group")],
    "pipe": [("get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size",
              "get_pipeline_model_parallel_group"),
             ("get_pipe_parallel_rank", "get_pipe_parallel_world_size", "get_pipe_parallel_group")],
    "sequence_data": [("get_sequence_data_parallel_rank", "get_sequence_data_parallel_world_size",
                       "get_sequence_data_parallel_group")],
}


def check(mpu, rank, world, tp, pp, sp):
    expected = reference(rank, world, tp, pp, sp)
    for axis, triples in QUESTIONS.items():
        my_rank, ranks = expected[axis]
        for rank_q, size_q, group_q in triples:
            assert getattr(mpu, rank_q)() == my_rank, (axis, rank_q)
            assert getattr(mpu, size_q)() == len(ranks), (axis, size_q)
            group = getattr(mpu, group_q)()
            assert dist.get_process_group_ranks(group) == ranks, (axis, group_q)
        # the group connects exactly those ranks: a sum of global ranks over it
        t = torch.tensor([float(rank)])
        ds_comm.all_reduce(t, group=getattr(mpu, triples[0][2])())
        assert t.item() == sum(ranks), axis
    assert mpu.get_data_parallel_group_ranks() == expected["data"][1]
    assert mpu.get_tensor_model_parallel_src_rank() == expected["tensor"][1][0]
    assert mpu.get_data_parallel_src_rank() == expected["data"][1][0]
    pipe_ranks = expected["pipe"][1]
    assert mpu.get_stage_id() == expected["pipe"][0]
    assert mpu.is_pipeline_first_stage() == (expected["pipe"][0] == 0)
    assert mpu.is_pipeline_last_stage() == (expected["pipe"][0] == pp - 1)
    assert [mpu.stage_to_global(i) for i in range(pp)] == pipe_ranks
    assert mpu.get_pipeline_model_parallel_next_rank() == pipe_ranks[(expected["pipe"][0] + 1) % pp]
    assert mpu.get_pipeline_model_parallel_prev_rank() == pipe_ranks[(expected["pipe"][0] - 1) % pp]
    assert not hasattr(mpu, "initialize_sequence_parallel")  # DeepSpeed would then ignore its groups


def check_layouts(rank, world):
    for tp, pp, sp in ((2, 1, 1), (2, 2, 1), (1, 1, 2), (1, 2, 2), (2, 1, 2), (1, 1, 1), (4, 1, 1)):
        check(ModelParallelUnit(tensor_parallel_size=tp, pipeline_parallel_size=pp, sequence_parallel_size=sp),
              rank, world, tp, pp, sp)
    # a ds-pipe style topology (axes pipe, data, model): the same groups as the sizes give
    mpu = ModelParallelUnit(topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1))
    check(mpu, rank, world, 2, 2, 1)
    assert mpu.topology().axes == ["pipe", "data", "model"]
    with pytest.raises(ValueError, match=r"world size 4 is not divisible by .* = 3"):
        ModelParallelUnit(tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int, got 0"):
        ModelParallelUnit(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="topology has 2 ranks but the world size is 4"):
        ModelParallelUnit(topology=PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=1))
    with pytest.raises(ValueError, match="axis 'expert'"):
        ModelParallelUnit(topology=ds_comm.ProcessTopology(["expert", "data"], [2, 2]))
    return True


def test_group_layouts_four_ranks():
    assert spawn(check_layouts, world_size=4) == [True] * 4


def test_reference_layout_is_tensor_fastest():
    # the reference itself: TP2 x DP2 puts tensor-parallel ranks next to each other
    assert reference(1, 4, 2, 1, 1)["tensor"] == (1, [0, 1])
    assert reference(1, 4, 2, 1, 1)["data"] == (0, [1, 3])
    assert reference(3, 8, 2, 2, 1)["pipe"] == (0, [3, 7])


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="not initialised"):
        ModelParallelUnit()
