"""``DeepSpeedEngine.load_moe_state_dict``: a DeepSpeed checkpoint's per-expert files read into a state dict.

The files are written here as DeepSpeed's ``_save_moe_checkpoint`` lays them out (checked once against a
checkpoint DeepSpeed 0.19.8 wrote): one file per MoE layer and global expert id,
``<tag>/layer_<L>_expert_<global>_mp_rank_00_model_states.pt`` (``old_moe_load``: one per expert,
``expert_<global>_mp_rank_00_model_states.pt``, every layer's copy of it), a dict of the expert's
tensors (parameters and buffers) under ``<MoE layer's name>.deepspeed_moe.experts.deepspeed_experts.<global
id>.<expert's own name>``. Loaded on 2 ranks at ep_size 2 (2 local experts each: rank r holds global
experts 2r, 2r + 1) and ep_size 1 (all 4 on each rank), each local expert must equal the file of its
global id (the reference: ``global = ep_rank * num_local + local``, written out here)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import ds_all
from ds_comm.testing import spawn

D, EXPERTS, LAYERS, TAG = 4, 4, 2, "global_step3"
_TENSORS = {"0.weight": (D, D), "0.bias": (D,), "1.running_mean": (D,), "1.running_var": (D,)}


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D))


class Net(nn.Module):
    def __init__(self, ep: int) -> None:
        super().__init__()
        from ds_all.moe.layer import MoE

        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(nn.ModuleDict({"moe": MoE(D, _expert(), num_experts=EXPERTS, ep_size=ep)})
                                    for _ in range(LAYERS))


def _key(layer: int, expert: int, rest: str) -> str:
    return f"blocks.{layer}.moe.deepspeed_moe.experts.deepspeed_experts.{expert}.{rest}"


def _value(layer: int, expert: int, rest: str) -> torch.Tensor:
    """The tensor the checkpoint holds for (layer, global expert, name): different for each."""
    g = torch.Generator().manual_seed(1000 * layer + 10 * expert + list(_TENSORS).index(rest))
    return torch.randn(_TENSORS[rest], generator=g)


def _write_deepspeed_files(root: str, old: bool = False, mp_rank: int = 0) -> None:
    """What DeepSpeed's ``_save_moe_checkpoint`` writes, with ``torch.save``: one file per (layer, global
    expert), or (``old``) per global expert holding every layer's copy."""
    os.makedirs(os.path.join(root, TAG), exist_ok=True)
    for expert in range(EXPERTS):
        files = {f"expert_{expert}": range(LAYERS)} if old else \
            {f"layer_{layer}_expert_{expert}": [layer] for layer in range(LAYERS)}
        for stem, layers in files.items():
            tensors = {_key(layer, expert, rest): _value(layer, expert, rest) for layer in layers for rest in _TENSORS}
            torch.save(tensors, os.path.join(root, TAG, f"{stem}_mp_rank_{mp_rank:02d}_model_states.pt"))


def load_run(rank, world_size, root, ep, old):
    torch.manual_seed(0)
    if old:  # through an engine: DeepSpeed's old format finds the experts through the engine's expert groups
        engine, *_ = ds_all.initialize(model=Net(ep), config={"train_micro_batch_size_per_gpu": 1,
                                                              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        model, num_experts = engine.module, engine.num_experts
    else:
        model, num_experts, engine = Net(ep), 1, None
        for layer in model.blocks:
            layer["moe"].set_deepspeed_parallelism()
    state_dict = {"kept": torch.ones(1)}  # updated in place
    ds_all.DeepSpeedEngine.load_moe_state_dict(root, TAG, state_dict, old, model=model, num_experts=num_experts)
    result = model.load_state_dict(state_dict, strict=False)
    assert result.unexpected_keys == ["kept"], result
    local = EXPERTS // ep
    loaded = {}
    for layer in range(LAYERS):
        experts = model.blocks[layer]["moe"].deepspeed_moe.experts.deepspeed_experts
        for i, one in enumerate(experts):
            state = one.state_dict()
            for rest in _TENSORS:
                loaded[(layer, (rank % ep) * local + i, rest)] = state[rest].clone()
    if engine is not None:
        engine.destroy()
    return sorted(state_dict), loaded


@pytest.mark.parametrize("old", [False, True], ids=["layer_files", "old_moe_load"])
@pytest.mark.parametrize("ep", [2, 1])
def test_each_local_expert_gets_its_global_experts_file(tmp_path, ep, old):
    _write_deepspeed_files(str(tmp_path), old=old)
    local = EXPERTS // ep
    for rank, (keys, loaded) in enumerate(spawn(load_run, world_size=2, args=(str(tmp_path), ep, old), timeout=240)):
        first = (rank % ep) * local
        expected_keys = {_key(layer, i, rest) for layer in range(LAYERS) for i in range(local) for rest in _TENSORS}
        assert set(keys) == expected_keys | {"kept"}  # renamed to local indices, nothing else added
        assert sorted({e for _, e, _ in loaded}) == list(range(first, first + local))
        for (layer, expert, rest), value in loaded.items():
            assert torch.equal(value, _value(layer, expert, rest)), (rank, layer, expert, rest)


def test_model_parallel_rank_names_the_file(tmp_path):
    _write_deepspeed_files(str(tmp_path), mp_rank=1)
    model, state_dict = Net(1), {}
    with pytest.raises(FileNotFoundError, match=r"MoE layer 0, expert 0 .*layer_0_expert_0_mp_rank_00_model_states"):
        ds_all.DeepSpeedEngine.load_moe_state_dict(str(tmp_path), TAG, state_dict, False, model=model)

    class MPU:
        def get_model_parallel_rank(self) -> int:
            return 1

    ds_all.DeepSpeedEngine.load_moe_state_dict(str(tmp_path), TAG, state_dict, False, model=model, mpu=MPU())
    assert torch.equal(state_dict[_key(1, 3, "0.weight")], _value(1, 3, "0.weight"))
    other: dict = {}
    ds_all.DeepSpeedEngine.load_moe_state_dict(str(tmp_path), TAG, other, False, model=model, checkpoint_mp_rank=1)
    assert sorted(other) == sorted(state_dict)


def test_missing_files_and_ds_checkpoints_are_named(tmp_path):
    _write_deepspeed_files(str(tmp_path))
    os.remove(tmp_path / TAG / "layer_1_expert_2_mp_rank_00_model_states.pt")
    with pytest.raises(FileNotFoundError, match=r"MoE layer 1, expert 2 \(global id; local expert 2 of this rank\): "
                                                r".*layer_1_expert_2_mp_rank_00_model_states\.pt"):
        ds_all.DeepSpeedEngine.load_moe_state_dict(str(tmp_path), TAG, {}, False, model=Net(1))
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "engine_meta.json").write_text("{}")
    with pytest.raises(ValueError, match=r"ours is a checkpoint ds-all wrote .* use engine\.load_checkpoint"):
        ds_all.DeepSpeedEngine.load_moe_state_dict(str(tmp_path), "ours", {}, False, model=Net(1))
    with pytest.raises(ValueError, match="model must be the module holding the MoE layers"):
        ds_all.DeepSpeedEngine.load_moe_state_dict(str(tmp_path), TAG, {}, False)
    with pytest.raises(NotImplementedError, match="AutoEP"):
        ds_all.DeepSpeedEngine.load_moe_state_dict(str(tmp_path), TAG, {}, False, model=Net(1), autoep_layers=[])
