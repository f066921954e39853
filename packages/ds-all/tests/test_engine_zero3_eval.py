"""A ZeRO-3 engine without an optimizer (evaluation) on 2 ranks, as DeepSpeed's (its DeepSpeedZeRoOffload):
the model is partitioned, each module gathers its parameters around its forward, the output equals the
unpartitioned model's bit for bit (built under ds_zero.Init or not), each rank holds only its shard
between forwards, and training calls are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ds_all
import ds_zero
from ds_comm.testing import spawn

IN, HIDDEN, OUT = 8, 16, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUT))


def _config(threshold: int | None, offload_param: str | None = None) -> dict:
    zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    if offload_param is not None:
        zero["offload_param"] = {"device": offload_param, "pin_memory": True}
    if threshold is not None:
        zero["stage3_param_persistence_threshold"] = threshold
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}


def evaluate(rank, world_size, use_init, threshold, path, offload_param=None):
    reference = _model()
    config = _config(threshold, offload_param)
    if use_init:
        with ds_zero.Init(config_dict_or_path=config):
            model = _model()
    else:
        model = copy.deepcopy(reference)
    engine, optimizer, _, scheduler = ds_all.initialize(model=model, config=config)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(rank))
    engine.eval()
    with torch.no_grad():
        first = engine(x)
    held = [p.numel() for p in model.parameters()]  # between forwards: shards only, in ZeroInference
    with torch.no_grad():
        second = engine(x)
    with_grad = engine(x)  # a forward with autograd on works too
    shapes = [tuple(p.ds_shape) for p in model.parameters()]
    partition = engine._zero_inference._partition.numel()
    messages = {}
    for call in (lambda: engine.backward(with_grad.sum()), engine.step):
        try:
            call()
        except RuntimeError as e:
            messages[len(messages)] = str(e)
    with ds_zero.GatheredParameters(list(model.parameters())):
        gathered = all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    engine.empty_partition_cache()
    saved = engine.save_16bit_model(path)  # gathered one module at a time, written by rank 0
    engine.destroy()  # every parameter whole again
    whole = all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    with torch.no_grad():
        expected = reference(x)
    return {"equal": [torch.equal(out, expected) for out in (first, second, with_grad.detach())],
            "held": held, "shapes": shapes, "partition": partition, "messages": messages,
            "optimizer": optimizer, "scheduler": scheduler, "gathered": gathered, "whole": whole, "saved": saved}


@pytest.mark.parametrize("use_init", [False, True], ids=["plain", "init"])
def test_zero3_engine_without_optimizer_evaluates_the_partitioned_model(use_init, tmp_path):
    total = sum(p.numel() for p in _model().parameters())
    shapes = [tuple(p.shape) for p in _model().parameters()]
    for result in spawn(evaluate, world_size=2, args=(use_init, 0, str(tmp_path))):
        assert result["equal"] == [True, True, True]
        assert result["held"] == [0] * len(shapes)  # every unit released after the forward
        assert result["shapes"] == shapes
        # this rank's shard of every unit: half the parameters (each of the 5 units padded to an even size)
        assert total // 2 <= result["partition"] <= total // 2 + 5
        assert result["optimizer"] is None and result["scheduler"] is None
        assert len(result["messages"]) == 2
        for message in result["messages"].values():
            assert "this engine has no optimizer" in message
        assert result["gathered"] and result["whole"] and result["saved"]
    saved = torch.load(tmp_path / "pytorch_model.bin")
    expected = _model().state_dict()
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in expected)


@pytest.mark.parametrize("use_init", [False, True], ids=["plain", "init"])
def test_zero3_engine_without_optimizer_with_parameters_offloaded_to_the_cpu(use_init, tmp_path):
    # offload_param {device: cpu} (DeepSpeed's ZeRO-Offload of parameters): the same outputs as the plain model
    for result in spawn(evaluate, world_size=2, args=(use_init, 0, str(tmp_path), "cpu")):
        assert result["equal"] == [True, True, True]
        assert result["held"] == [0] * 6
        assert result["gathered"] and result["whole"] and result["saved"]


def test_zero3_engine_without_optimizer_with_persistent_units(tmp_path):
    # DeepSpeed's default threshold keeps modules this small whole on every rank: same outputs
    for result in spawn(evaluate, world_size=2, args=(True, None, str(tmp_path))):
        assert result["equal"] == [True, True, True]
        assert result["gathered"] and result["whole"]


def evaluate_bf16(rank, world_size):
    reference = copy.deepcopy(_model()).bfloat16()
    model = _model()
    config = {**_config(0), "bf16": {"enabled": True}}
    engine, *_ = ds_all.initialize(model=model, config=config)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(rank)).bfloat16()
    with torch.no_grad():
        out, expected = engine(x), reference(x)
    dtypes = {p.dtype for p in model.parameters()}
    engine.destroy()
    return out.dtype, dtypes, torch.equal(out, expected)


def test_zero3_engine_without_optimizer_casts_the_parameters_to_bf16():
    # as DeepSpeed's engine casts the model's parameters for bf16 with or without an optimizer
    for dtype, dtypes, equal in spawn(evaluate_bf16, world_size=2):
        assert dtype == torch.bfloat16 and dtypes == {torch.bfloat16} and equal
