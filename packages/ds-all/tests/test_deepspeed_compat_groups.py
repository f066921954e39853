"""``ds_all.utils.groups`` (DeepSpeed's ``deepspeed.utils.groups``) on two ranks: the sizes, ranks and groups of
each kind of parallelism without an mpu, with a pipe × data topology, with a model-parallel topology and after
``initialize`` with a PipelineModule; each group checked by a collective over it, each size and rank against
the rank layout worked out here (ranks row-major over the axes, the last fastest)."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from ds_comm.testing import spawn


def _answers(groups) -> dict:
    out = {}
    for name in ("get_data_parallel_world_size", "get_data_parallel_rank", "get_model_parallel_world_size",
                 "get_model_parallel_rank", "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank",
                 "get_tensor_model_parallel_src_rank", "get_sequence_parallel_world_size",
                 "get_sequence_parallel_rank", "get_sequence_data_parallel_world_size",
                 "get_sequence_data_parallel_rank", "_get_data_parallel_world_size", "_get_data_parallel_rank",
                 "_get_model_parallel_world_size", "_get_sequence_parallel_world_size",
                 "_get_sequence_data_parallel_world_size", "_get_data_parallel_group_ranks", "_get_broadcast_src_rank"):
        out[name] = getattr(groups, name)()
    return out


def _sum_over(group, rank) -> float:
    """1 + the global rank, summed over ``group``: which ranks are in it."""
    import ds_comm

    t = torch.tensor([1.0 + rank])
    ds_comm.all_reduce(t, group=group)
    return float(t)


def _errors(groups) -> dict:
    out = {}
    for name in ("get_model_parallel_group", "get_tensor_model_parallel_group", "get_sequence_parallel_group",
                 "_get_expert_parallel_world_size", "_get_expert_parallel_group", "_get_max_expert_size"):
        try:
            value = getattr(groups, name)("ep_size_2") if "expert_parallel" in name else getattr(groups, name)()
            out[name] = value if name == "_get_max_expert_size" else None  # a size, or None: no group
        except (RuntimeError, NotImplementedError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def layouts(rank, world_size):
    import ds_comm
    from ds_all.utils import groups

    out = {"none": {**_answers(groups), "dp_sum": _sum_over(groups.get_data_parallel_group(), rank),
                    "errors": _errors(groups), "dicts": (groups._get_expert_parallel_group_dict(),
                                                         groups._get_expert_data_parallel_group_dict()),
                    "expert_mp": groups._get_expert_model_parallel_world_size()}}

    groups.mpu = ds_comm.Grid(ds_comm.PipeDataParallelTopology(num_pp=2, num_dp=1))
    out["pipe"] = {**_answers(groups), "dp_sum": _sum_over(groups.get_data_parallel_group(), rank),
                   "errors": _errors(groups)}

    groups.mpu = ds_comm.Grid(ds_comm.PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=1))
    out["model"] = {**_answers(groups), "dp_sum": _sum_over(groups.get_data_parallel_group(), rank),
                    "mp_sum": _sum_over(groups.get_model_parallel_group(), rank),
                    "tp_sum": _sum_over(groups.get_tensor_model_parallel_group(), rank)}
    groups.set_tensor_model_parallel_world_size(1)
    groups.set_tensor_model_parallel_rank(0)
    out["model, tp set"] = (groups.get_tensor_model_parallel_world_size(), groups.get_tensor_model_parallel_rank(),
                            groups.get_tensor_model_parallel_src_rank())
    groups.set_tensor_model_parallel_world_size(None)
    groups.set_tensor_model_parallel_rank(None)
    out["model, tp unset"] = groups.get_tensor_model_parallel_world_size()
    groups.mpu = None
    return out


def test_sizes_ranks_and_groups_with_and_without_a_topology():
    for rank, got in enumerate(spawn(layouts, world_size=2)):
        other = 1 - rank
        none = got["none"]  # no mpu: data parallelism over the world, every other kind one rank
        assert none["get_data_parallel_world_size"] == none["_get_data_parallel_world_size"] == 2
        assert none["get_data_parallel_rank"] == none["_get_data_parallel_rank"] == rank
        assert none["dp_sum"] == 3.0 and none["_get_data_parallel_group_ranks"] == [0, 1]
        assert (none["get_model_parallel_world_size"], none["get_model_parallel_rank"]) == (1, 0)
        assert (none["get_tensor_model_parallel_world_size"], none["get_tensor_model_parallel_rank"]) == (1, 0)
        assert none["get_tensor_model_parallel_src_rank"] == rank  # (rank // 1) * 1
        assert (none["get_sequence_parallel_world_size"], none["get_sequence_parallel_rank"]) == (1, 0)
        assert none["_get_sequence_parallel_world_size"] == 1
        assert (none["get_sequence_data_parallel_world_size"], none["get_sequence_data_parallel_rank"]) == (2, rank)
        assert none["_get_broadcast_src_rank"] == 0
        errors = none["errors"]
        assert errors["get_model_parallel_group"].startswith("RuntimeError: groups: there is no model-parallel group")
        assert "no mpu is registered" in errors["get_tensor_model_parallel_group"]
        assert errors["get_sequence_parallel_group"].startswith("RuntimeError: groups: there is no sequence-parallel")
        for name in ("_get_expert_parallel_world_size", "_get_expert_parallel_group"):  # ds-moe's: none created yet
            assert errors[name].startswith("RuntimeError: ds_moe.groups: expert parallel group 'ep_size_2' is not "
                                           "initialized")
        assert errors["_get_max_expert_size"] is None  # no expert group yet
        assert none["dicts"] == ({}, {}) and none["expert_mp"] == 1

        pipe = got["pipe"]  # pipe 2 x data 1: rank r is stage r, alone in its data-parallel group
        assert (pipe["get_data_parallel_world_size"], pipe["get_data_parallel_rank"]) == (1, 0)
        assert pipe["dp_sum"] == 1.0 + rank and pipe["_get_data_parallel_group_ranks"] == [rank]
        assert (pipe["get_model_parallel_world_size"], pipe["get_model_parallel_rank"]) == (1, 0)
        assert pipe["get_sequence_data_parallel_world_size"] == 1 and pipe["_get_broadcast_src_rank"] == rank
        assert "the mpu (Grid) has no model-parallel group" in pipe["errors"]["get_model_parallel_group"]

        model = got["model"]  # pipe 1 x data 1 x model 2: the two ranks are one model-parallel pair
        assert (model["get_model_parallel_world_size"], model["get_model_parallel_rank"]) == (2, rank)
        assert (model["get_tensor_model_parallel_world_size"], model["get_tensor_model_parallel_rank"]) == (2, rank)
        assert model["get_tensor_model_parallel_src_rank"] == 0
        assert model["mp_sum"] == model["tp_sum"] == 3.0
        assert (model["get_data_parallel_world_size"], model["get_data_parallel_rank"]) == (1, 0)
        assert model["dp_sum"] == 1.0 + rank and model["_get_data_parallel_group_ranks"] == [rank]
        assert model["_get_broadcast_src_rank"] == rank and other != rank
        assert got["model, tp set"] == (1, 0, rank) and got["model, tp unset"] == 2


def through_initialize(rank, world_size):
    import torch.nn.functional as F

    import ds_all
    from ds_all.utils import groups
    from ds_pipe import LayerSpec, PipelineModule

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    plain, *_ = ds_all.initialize(model=nn.Linear(2, 2), config=config)
    before = (groups.mpu, groups.get_data_parallel_world_size(), groups.get_data_parallel_rank())
    plain.destroy()
    module = PipelineModule([LayerSpec(nn.Linear, 2, 2), LayerSpec(nn.Linear, 2, 2)], num_stages=2,
                            loss_fn=F.mse_loss)
    engine, *_ = ds_all.initialize(model=module, config=config)
    after = (groups.mpu is module.mpu(), groups.get_data_parallel_world_size(), groups.get_data_parallel_rank(),
             groups.mpu.get_pipe_parallel_rank())
    engine.destroy()
    return before, after


def test_initialize_registers_the_pipeline_topology_as_the_mpu():
    for rank, (before, after) in enumerate(spawn(through_initialize, world_size=2)):
        assert before == (None, 2, rank)  # a plain model: no mpu, data parallelism over both ranks
        assert after == (True, 1, 0, rank)  # a pipeline of two stages: each rank its own data-parallel group


def test_groups_is_a_module_of_the_tree_and_the_utils_names_stay():
    groups = importlib.import_module("ds_all.utils.groups")
    import ds_all
    from ds_all.utils import RepeatingLoader, log_dist, logger, set_random_seed  # noqa: F401

    assert ds_all.utils.groups is groups and groups.mpu is None
    with pytest.raises(RuntimeError, match=r"groups\.get_data_parallel_world_size: no process group yet"):
        groups.get_data_parallel_world_size()
    with pytest.raises(ValueError, match=r"world_size must be an integer >= 1 or None, got 0"):
        groups.set_tensor_model_parallel_world_size(0)
    with pytest.raises(ValueError, match=r"rank must be an integer >= 0 or None, got -1"):
        groups.set_tensor_model_parallel_rank(-1)
