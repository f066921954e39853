"""DeepSpeed's tensor- and sequence-parallel module paths that its own unit tests import (issue 42), checked without
DeepSpeed: ``module_inject.tp_shard`` (both signatures), ``module_inject.layers`` (the AutoTP mode),
``runtime.utils.is_model_parallel_parameter``, ``utils.groups._init_tp_mesh_device`` (its group layout),
``runtime.sequence_parallel.parallel_state_sp`` as an mpu, ``sequence.fpdt_layer.FPDT_InputConstruct``, the
optimizer kinds of ``runtime.zero.stage_1_and_2`` / ``stage3``, and through ``initialize``:
``tensor_parallel.partition_config``, the first-batch check of a tensor-parallel group and
``_consolidated_16bit_state_dict`` under AutoTP (against the unsplit model), replicas made equal."""

import copy

import pytest
import torch
from torch import nn

import ds_all
import ds_comm
from ds_all.module_inject import layers as tp_layers
from ds_all.module_inject.tp_shard import AutoTPMeta, get_shard_size_list
from ds_all.runtime.utils import is_model_parallel_parameter
from ds_all.utils import groups
from ds_comm.testing import spawn


def test_shard_sizes_take_deepspeed_0_19_6_and_0_19_8_signatures():
    assert get_shard_size_list(129, 4, None) == [33, 32, 32, 32]  # 0.19.6: (total, mp_size, name)
    assert get_shard_size_list(10, 3, "lm_head") == [4, 3, 3]
    meta = AutoTPMeta(num_kv_heads=6)  # 0.19.8: (total, mp_size, meta, name)
    assert get_shard_size_list(96, 4, meta, "layers.0.k_proj") == [32, 32, 16, 16]
    assert get_shard_size_list(96, 4, meta, "layers.0.mlp.up_proj") == [24, 24, 24, 24]

    class Config:
        num_attention_heads, num_key_value_heads, hidden_size = 8, 2, 64

    assert AutoTPMeta.from_model_config(Config()) == AutoTPMeta(num_kv_heads=2, num_attention_heads=8, n_embd=64)
    with pytest.raises(ValueError, match="must be an AutoTPMeta"):
        get_shard_size_list(8, 2, 3)


def test_autotp_mode_and_model_parallel_marks():
    tp_layers.set_autotp_mode(training=False)
    assert not tp_layers.is_autotp_training_mode()
    frozen = tp_layers.LinearLayer(nn.Linear(4, 6))  # no process group: one rank
    assert not frozen.weight.requires_grad and not frozen.bias.requires_grad  # inference mode, as DeepSpeed
    assert is_model_parallel_parameter(frozen.weight) and is_model_parallel_parameter(frozen.bias)
    tp_layers.set_autotp_mode(training=True)
    try:
        row = tp_layers.LinearAllreduce(nn.Linear(4, 6), None, name="proj")
        assert row.weight.requires_grad and row.bias.requires_grad
        assert is_model_parallel_parameter(row.weight) and not is_model_parallel_parameter(row.bias)  # replicated
        assert not is_model_parallel_parameter(nn.Parameter(torch.zeros(1)))
        with pytest.raises(ValueError, match=r"unknown keyword argument.*bogus"):
            tp_layers.LinearLayer(nn.Linear(4, 6), None, bogus=1)
    finally:
        tp_layers.set_autotp_mode(training=False)


def test_init_tp_mesh_device_makes_data_then_tensor_groups_in_deepspeed_order(monkeypatch):
    made = []
    monkeypatch.setattr(groups, "_TENSOR_MODEL_PARALLEL_GROUP", None)
    monkeypatch.setattr(groups, "_MODEL_PARALLEL_GROUP", None)
    monkeypatch.setattr(groups, "_DATA_PARALLEL_GROUP", None)
    monkeypatch.setattr(groups.dist, "get_world_size", lambda group=None: 8 if group is None else len(group))
    monkeypatch.setattr(groups.dist, "get_rank", lambda group=None: 5 if group is None else group.index(5))
    monkeypatch.setattr(groups.dist, "new_group", lambda ranks: made.append(tuple(ranks)) or tuple(ranks))
    data, model = groups._init_tp_mesh_device(tensor_model_parallel_size=4)
    assert made == [(0, 4), (1, 5), (2, 6), (3, 7), (0, 1, 2, 3), (4, 5, 6, 7)]
    assert (data, model) == ((1, 5), (4, 5, 6, 7))
    assert groups.get_tensor_model_parallel_group() == (4, 5, 6, 7)
    assert groups.get_tensor_model_parallel_world_size() == 4 and groups.get_tensor_model_parallel_rank() == 1
    assert groups.get_data_parallel_world_size() == 2 and groups.get_data_parallel_rank() == 1
    assert groups._init_tp_mesh_device(tensor_model_parallel_size=2) is None  # made once
    monkeypatch.setattr(groups, "_TENSOR_MODEL_PARALLEL_GROUP", None)
    with pytest.raises(ValueError, match="tensor_model_parallel_size 3 does not divide the world size 8"):
        groups._init_tp_mesh_device(tensor_model_parallel_size=3)


def test_fpdt_input_construct_gives_each_rank_its_chunks():
    from ds_all.sequence.fpdt_layer import FPDT_InputConstruct, _FPDTGPUOffloadingAttentionImpl_

    class Args:
        ds_sequence_parallel_fpdt_chunk_size = 8

    tokens = torch.arange(32).reshape(2, 16)  # 16 tokens, 2 ranks, 2 chunks of 4 each: rank 1 has chunks 1, 3
    out = FPDT_InputConstruct(tokens, tokens + 100, None, None, tokens, Args(), 2, 1).generate()
    assert out[0][0].tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert out[1][1].tolist() == [120, 121, 122, 123, 128, 129, 130, 131]
    assert out[2] is None and out[3] is None and torch.equal(out[4], out[0])
    with pytest.raises(ValueError, match="sequence length 16 must be divisible"):
        FPDT_InputConstruct(tokens, None, None, None, None, type("A", (), {"ds_sequence_parallel_fpdt_chunk_size": 5})(),
                            2, 0)
    with pytest.raises(NotImplementedError, match="not built in ds"):
        _FPDTGPUOffloadingAttentionImpl_.apply(torch.zeros(1, requires_grad=True))


# ---- through initialize (2 ranks) ----------------------------------------------------------------------------

class Net(nn.Module):
    def __init__(self, vocab=5):
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.lm_head = nn.Linear(6, vocab)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.lm_head(torch.relu(self.body(x))), y)


RULES = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r"body\.weight$"], "partition_type": "skip"},
    {"patterns": [r".*lm_head\.weight$"], "partition_type": "column", "gather_output": True},
]}


def run_partition_config(rank, world):
    from ds_all.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from ds_all.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    torch.manual_seed(0)
    model = Net()
    whole = copy.deepcopy(model)
    with torch.no_grad():
        model.body.weight.add_(rank)  # a replica built differently: initialize makes it tensor-parallel rank 0's
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2, "partition_config": RULES}}
    engine, optimizer, _, _ = ds_all.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert tp_layers.is_autotp_training_mode()
    assert isinstance(engine.module.lm_head, tp_layers.LinearLayer.__mro__[1])  # ds-parallel's column layer
    assert engine.module.lm_head.weight.shape == ((3, 6), (2, 6))[rank]  # 5 outputs: 3 + 2
    assert isinstance(engine.module.body, nn.Linear)  # skip
    torch.testing.assert_close(engine.module.body.weight, whole.body.weight, rtol=0, atol=0)
    assert isinstance(optimizer, DeepSpeedZeroOptimizer) and not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3)
    state = engine._consolidated_16bit_state_dict()
    if rank == 0:
        assert state.keys() == whole.state_dict().keys()
        for key, value in whole.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    else:
        assert state is None
    x = torch.randn(1, 4, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([3])
    mismatch = None
    try:
        engine(x + rank, y)  # the tensor-parallel group's ranks must see the same batch
    except ValueError as err:
        mismatch = err
    assert isinstance(mismatch, AssertionError) and str(mismatch).startswith("Data inconsistency within the TP group")
    loss = engine(x, y)  # the same batch: checked once, then the check is gone
    torch.testing.assert_close(loss, whole(x, y))
    engine.backward(loss)
    engine.step()
    return True


def test_partition_config_first_batch_check_and_consolidated_state_through_initialize():
    assert spawn(run_partition_config, world_size=2) == [True, True]


def run_sequence_only_mpu(rank, world, tmp):
    from ds_all.runtime.sequence_parallel import parallel_state_sp as sp_mpu

    sp_mpu.initialize_sequence_parallel(world)
    assert sp_mpu.get_sequence_parallel_world_size() == world and sp_mpu.get_model_parallel_rank() == rank
    assert ds_comm.get_world_size(sp_mpu.get_sequence_data_parallel_group()) == world
    with pytest.raises(RuntimeError, match="exist already"):
        sp_mpu.initialize_sequence_parallel(world)
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    config = {"train_batch_size": world, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 1}}
    engine, _, _, _ = ds_all.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=sp_mpu)
    assert engine.mp_world_size == 1 and engine.sequence_parallel_size == world and engine.checkpoint_mp_rank == 0
    engine.save_checkpoint(tmp, tag="sp")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    engine.load_checkpoint(tmp, tag="sp")
    for key, value in engine.module.state_dict().items():
        assert torch.equal(value, expected[key])
    return True


def test_parallel_state_sp_is_a_sequence_only_mpu(tmp_path):
    assert spawn(run_sequence_only_mpu, world_size=2, args=(str(tmp_path),)) == [True, True]


def run_mesh_param(rank, world):
    model = nn.Linear(4, 4)
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = ds_all.initialize(model=model, model_parameters=model.parameters(), config=config,
                                        mesh_param=(1, world))  # DeepSpeed's (data, sequence) mesh
    assert engine.sequence_parallel_size == world and ds_comm.get_world_size(engine.seq_parallel_group) == world
    assert engine.dp_world_size == 1
    with pytest.raises(ValueError, match=r"mesh_param \(1, 2\) gives sequence_parallel_size 2, the config 1"):
        ds_all.initialize(model=nn.Linear(4, 4), config={**config, "sequence_parallel_size": 1}, mesh_param=(1, 2))
    with pytest.raises(ValueError, match="mesh_param must be"):
        ds_all.initialize(model=nn.Linear(4, 4), config=config, mesh_param=(2,))
    return True


def test_initialize_mesh_param_is_data_by_sequence_parallel_sizes():
    assert spawn(run_mesh_param, world_size=2) == [True, True]
