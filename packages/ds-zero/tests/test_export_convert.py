"""DeepSpeed's ``convert_zero_checkpoint_to_fp32_state_dict`` / ``convert_zero_checkpoint_to_state_dict``: a
ZeRO checkpoint written as ``pytorch_model.bin`` (or ``model.safetensors``) under a directory, split into
Hugging Face style shards with an index above ``max_shard_size``, in the dtype asked; and
``exclude_frozen_parameters`` leaving out exactly the frozen parameters (the buffers stay)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ds_comm.testing import spawn
from ds_zero import (
    ZeroOptimizer,
    convert_zero_checkpoint_to_fp32_state_dict,
    convert_zero_checkpoint_to_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    save_zero_checkpoint,
)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(4, 6)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(6, 6)
        self.tail = nn.Linear(6, 6)
        self.tail.weight = self.head.weight  # tied: two names, one tensor
        self.register_buffer("offset", torch.arange(6.0))

    def forward(self, x):
        return self.tail(torch.tanh(self.head(self.frozen(x)))) + self.offset


def train_and_save(rank, world_size, stage, path):
    model = Model()
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={"lr": 0.05}, config={"stage": stage})
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        zero.backward(model(x).square().mean())
        zero.step()
        zero.zero_grad()
    save_zero_checkpoint(zero, path)
    zero.close()


@pytest.mark.parametrize("stage", [1, 3])
def test_convert_writes_deepspeeds_files(stage, tmp_path):
    checkpoint = tmp_path / "ck"
    spawn(train_and_save, world_size=2, args=(stage, str(checkpoint)))
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint)
    assert set(state) == set(Model().state_dict())
    frozen = {"frozen.weight", "frozen.bias"}

    written = convert_zero_checkpoint_to_fp32_state_dict(checkpoint, tmp_path / "one")
    assert [p.name for p in written] == ["pytorch_model.bin"]
    loaded = torch.load(tmp_path / "one" / "pytorch_model.bin", weights_only=True)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    fresh = Model()
    fresh.load_state_dict(loaded)  # strict: every name, the tied alias included

    # safetensors, shards of at most 150 bytes (a 6x6 float32 weight is 144): one tensor or two per shard
    written = convert_zero_checkpoint_to_fp32_state_dict(checkpoint, tmp_path / "sharded", max_shard_size=150,
                                                         safe_serialization=True)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted({name for name in index["weight_map"].values()})
    assert len(shards) > 1 and all(name.startswith("model-") and name.endswith(".safetensors") for name in shards)
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    from safetensors.torch import load_file
    merged = {}
    for name in shards:
        merged.update(load_file(str(tmp_path / "sharded" / name)))
    assert merged.keys() == state.keys() and all(torch.equal(merged[k], state[k]) for k in state)
    assert len(written) == len(shards) + 1

    halves = convert_zero_checkpoint_to_state_dict(checkpoint, tmp_path / "bf16", dtype="bf16",
                                                   exclude_frozen_parameters=True)
    loaded = torch.load(halves[0], weights_only=True)
    assert set(loaded) == set(state) - frozen  # the buffer stays, the frozen parameters go
    assert all(loaded[k].dtype == torch.bfloat16 and torch.equal(loaded[k], state[k].bfloat16()) for k in loaded)
    assert set(get_fp32_state_dict_from_zero_checkpoint(checkpoint, exclude_frozen_parameters=True)) == \
        set(state) - frozen


class Bigger(Model):
    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(2, 2)


def test_load_state_dict_from_zero_checkpoint_is_not_strict_as_deepspeeds(tmp_path, caplog):
    spawn(train_and_save, world_size=2, args=(2, str(tmp_path)))
    model = Bigger()
    extra = model.extra.weight.detach().clone()
    with caplog.at_level("WARNING", logger="ds_zero._export"):
        loaded = load_state_dict_from_zero_checkpoint(model, tmp_path)
    assert loaded is model and torch.equal(model.extra.weight, extra)  # not in the checkpoint: kept
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert "extra.weight" in caplog.text


def test_convert_refuses_a_bad_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype must be float32, float16 or bfloat16"):
        convert_zero_checkpoint_to_state_dict(tmp_path, tmp_path / "out", dtype=torch.int8)
