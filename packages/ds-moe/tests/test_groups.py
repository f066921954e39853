"""Expert-parallel / expert-data-parallel groups as DeepSpeed's ``deepspeed.utils.groups`` makes them."""

import pytest
import torch

import ds_comm
from ds_comm.testing import spawn
from ds_moe import groups

# world 4: (ep_size, use_data_before_expert_parallel_) -> (expert-parallel groups, expert-data-parallel groups),
# written out from DeepSpeed's docstring rule (E + D: consecutive expert groups; D + E: strided).
EXPECTED = {
    (1, False): ([[0], [1], [2], [3]], [[0, 1, 2, 3]]),
    (2, False): ([[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    (4, False): ([[0, 1, 2, 3]], [[0], [1], [2], [3]]),
    (1, True): ([[0], [1], [2], [3]], [[0, 1, 2, 3]]),
    (2, True): ([[0, 2], [1, 3]], [[0, 1], [2, 3]]),
    (4, True): ([[0, 1, 2, 3]], [[0], [1], [2], [3]]),
}


def build_all(rank, world_size):
    out = {}
    for before in (False, True):
        groups._reset_expert_groups()
        for ep in (1, 2, 4):
            groups._create_expert_and_data_parallel(ep, use_data_before_expert_parallel_=before)
            name = f"ep_size_{ep}"
            ep_group, edp_group = groups._get_expert_parallel_group(name), groups._get_expert_data_parallel_group(name)
            total = torch.tensor([float(rank)])
            ds_comm.all_reduce(total, group=ep_group)  # the group really holds those ranks
            out[(ep, before)] = dict(
                ep_ranks=list(groups._get_expert_parallel_group_ranks(name)),
                edp_ranks=list(groups._get_expert_data_parallel_group_ranks(name)),
                ep_world=groups._get_expert_parallel_world_size(name),
                ep_rank=groups._get_expert_parallel_rank(name),
                edp_world=groups._get_expert_data_parallel_world_size(name),
                edp_rank=groups._get_expert_data_parallel_rank(name),
                src=groups._get_expert_parallel_src_rank(name),
                bcast=groups._get_expert_broadcast_src_rank(name),
                ep_sum=total.item(),
                edp_is_dict=groups._get_expert_data_parallel_group_dict()[name] is edp_group)
        out[("max", before)] = (groups._get_max_expert_size(), groups._get_max_expert_size_name(),
                                groups._get_max_expert_parallel_group() is groups._get_expert_parallel_group("ep_size_4"),
                                sorted(groups._get_expert_parallel_group_dict()))
    try:
        groups._create_expert_and_data_parallel(3)
    except ValueError as err:
        out["bad"] = str(err)
    try:
        groups._get_expert_parallel_group("ep_size_8")
    except RuntimeError as err:
        out["unknown"] = str(err)
    return out


def test_groups_on_four_ranks_in_both_orders():
    results = spawn(build_all, world_size=4)
    for rank, got in enumerate(results):
        for (ep, before), (ep_groups, edp_groups) in EXPECTED.items():
            mine_ep = next(g for g in ep_groups if rank in g)
            mine_edp = next(g for g in edp_groups if rank in g)
            assert got[(ep, before)] == dict(
                ep_ranks=mine_ep, edp_ranks=mine_edp, ep_world=ep, ep_rank=mine_ep.index(rank),
                edp_world=len(mine_edp), edp_rank=mine_edp.index(rank), src=(rank // ep) * ep, bcast=mine_edp[0],
                ep_sum=float(sum(mine_ep)), edp_is_dict=True), (rank, ep, before)
        for before in (False, True):
            assert got[("max", before)] == (4, "ep_size_4", True, ["ep_size_1", "ep_size_2", "ep_size_4"])
        assert "ep_size=3" in got["bad"] and "world size 4" in got["bad"]
        assert "'ep_size_8' is not initialized" in got["unknown"]


def test_rank_lists_with_pipeline_stages_and_tensor_parallel_order():
    from ds_moe._groups import _expert_group_ranks

    # 8 ranks, 2 pipeline stages of 4: groups are made inside each stage.
    assert _expert_group_ranks(8, 2, pp_size=2) == ([[0, 1], [2, 3], [4, 5], [6, 7]],
                                                    [[0, 2], [1, 3], [4, 6], [5, 7]])
    # mp_size=2 (DeepSpeed 0.19.8's _create_expert_and_data_parallel, mp_mode "tp"): the stage's ranks are
    # reordered tensor-parallel lane by lane (0 2 4 ... 14 1 3 ... 15), cut into expert groups of 4, and
    # position i of every expert group forms an expert-data-parallel group.
    ep, edp = _expert_group_ranks(16, 4, mp_size=2)
    assert ep == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert edp == [[0, 8, 1, 9], [2, 10, 3, 11], [4, 12, 5, 13], [6, 14, 7, 15]]
    ep, edp = _expert_group_ranks(16, 4, mp_size=2, mp_mode="sp")  # "sp": consecutive
    assert ep == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert edp == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    with pytest.raises(ValueError, match="ep_size=3 does not divide the world size 8"):
        _expert_group_ranks(8, 3)


def test_no_process_group_is_refused_by_name():
    assert not ds_comm.is_initialized()
    with pytest.raises(RuntimeError, match="no process group"):
        groups._create_expert_and_data_parallel(1)
    with pytest.raises(RuntimeError, match="no process group"):
        groups._get_expert_parallel_world_size("ep_size_1")
