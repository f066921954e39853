"""Frozen parameters (``requires_grad=False``) through `ds_all.initialize` on 2 ranks, as DeepSpeed takes
them: ``model_parameters`` holding every parameter (``model.parameters()``, the usual call) and a client
optimizer built over all of them are accepted, the frozen ones are never stepped (DeepSpeed's ZeRO keeps
only trainable parameters in its groups), the trainable ones equal torch's DDP with AdamW over the
trainable parameters bit for bit at stages 0-3, and ``save_checkpoint(exclude_frozen_parameters=...)``
saves or leaves out the frozen weights, which ``load_checkpoint`` restores (on another stage too)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_all
import ds_comm
import ds_zero
from ds_comm.testing import spawn

IN, HIDDEN, OUT, STEPS, LR = 8, 16, 4, 4, 1e-2


def _model() -> nn.Module:
    """A frozen first layer (a pretrained backbone), a trainable middle, a frozen last weight with a
    trainable bias."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                          nn.Linear(HIDDEN, OUT))
    model[0].requires_grad_(False)
    model[4].weight.requires_grad_(False)
    return model


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, IN, generator=g), torch.randn(4, OUT, generator=g)


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _reference(rank):
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in range(STEPS):
        x, y = _batch(step, rank)
        _loss(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _config(stage: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 10
    return {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero}


def _engine(stage: int, how: str):
    model = _model()
    if how == "client optimizer":  # built over every parameter, the frozen ones included
        return ds_all.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                 config=_config(stage))[0]
    if how == "model_parameters":
        return ds_all.initialize(model=model, model_parameters=model.parameters(),
                                 optimizer=lambda params: torch.optim.AdamW(params, lr=LR), config=_config(stage))[0]
    groups = [{"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if n.endswith("weight")]}]
    return ds_all.initialize(model=model, model_parameters=groups,
                             optimizer=lambda params: torch.optim.AdamW(params, lr=LR), config=_config(stage))[0]


def _whole(model) -> dict[str, torch.Tensor]:
    with ds_zero.GatheredParameters(list(model.parameters())):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def train(rank, world_size, stage, how):
    reference = _reference(rank) if how != "groups" else None
    engine = _engine(stage, how)
    initial = {name: p.detach().clone() for name, p in _model().named_parameters()}
    for step in range(STEPS):
        x, y = _batch(step, rank)
        engine.backward(_loss(engine(x), y))
        engine.step()
    held = {name: p.numel() for name, p in engine.module.named_parameters()}
    whole = _whole(engine.module)
    frozen = [name for name, p in engine.module.named_parameters() if not p.requires_grad]
    unchanged = all(torch.equal(whole[name], initial[name]) for name in frozen)
    moved = [name for name in whole if name not in frozen and not torch.equal(whole[name], initial[name])]
    same = reference is None or all(torch.equal(whole[name], reference[name]) for name in whole)
    return unchanged, moved, same, held


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("how", ["client optimizer", "model_parameters", "groups"])
def test_frozen_parameters_are_accepted_and_not_stepped(stage, how):
    for unchanged, moved, same, held in spawn(train, world_size=2, args=(stage, how)):
        assert unchanged and same
        assert moved == ["2.weight", "2.bias", "4.bias"] or (how == "groups" and "2.weight" in moved)
        if stage == 3:  # the frozen backbone layer is partitioned too
            assert held["0.weight"] == 0


def checkpoint_round_trip(rank, world_size, path, exclude):
    engine = _engine(3, "client optimizer")
    for step in range(2):
        x, y = _batch(step, rank)
        engine.backward(_loss(engine(x), y))
        engine.step()
    trained = _whole(engine.module)
    engine.save_checkpoint(path, tag="t", exclude_frozen_parameters=exclude)
    ds_comm.barrier()
    out = {}
    for stage in (1, 3):
        other = _engine(stage, "model_parameters")
        with ds_zero.GatheredParameters(list(other.module.parameters()), modifier_rank=0), torch.no_grad():
            for p in other.module.parameters():
                p.fill_(7.0)
        other.load_checkpoint(path, tag="t")
        loaded = _whole(other.module)
        frozen = {name for name, p in other.module.named_parameters() if not p.requires_grad}
        out[stage] = all(torch.equal(loaded[name], torch.full_like(loaded[name], 7.0) if exclude and name in frozen
                                     else trained[name]) for name in loaded)
    return out


@pytest.mark.parametrize("exclude", [False, True])
def test_save_checkpoint_with_and_without_the_frozen_parameters(tmp_path, exclude):
    for out in spawn(checkpoint_round_trip, world_size=2, args=(str(tmp_path / "ckpt"), exclude)):
        assert out == {1: True, 3: True}


def build_with_a_stranger(rank, world_size):
    model, stranger = _model(), nn.Parameter(torch.zeros(3))
    try:
        ds_all.initialize(model=model, model_parameters=[*model.parameters(), stranger],
                          optimizer=lambda params: torch.optim.AdamW(params, lr=LR), config=_config(1))
    except ValueError as e:
        return str(e)
    return None


def test_model_parameters_not_of_the_model_are_still_refused():
    for message in spawn(build_with_a_stranger, world_size=2):
        assert message is not None and "1 others" in message
