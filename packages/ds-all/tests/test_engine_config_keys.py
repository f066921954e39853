"""The engine acts on DeepSpeed 0.19's run-time keys: ``torch_autocast`` (the forward under torch.autocast, training
equal to a ZeRO loop whose forward runs under the same autocast), ``disable_python_gc``, ``log_level``,
``data_parallel_size``; ``backward`` returns the loss divided by the accumulation steps and ``deepspeed_io``'s
eval route keeps the data's order, as DeepSpeed's do."""

from __future__ import annotations

import copy
import gc
import logging

import pytest
import torch
from torch import nn

import ds_all
from ds_comm.testing import spawn
from ds_zero import ZeroOptimizer

IN, HIDDEN, MICRO, GAS = 8, 16, 4, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, 1))


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": 1}, "steps_per_print": 1000, **extra}


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(MICRO, IN, generator=g), torch.randn(MICRO, 1, generator=g)


def autocast_training(rank, world_size):
    model = _model()
    direct = copy.deepcopy(model)
    engine, *_ = ds_all.initialize(model=model, config=_config(torch_autocast={"enabled": True, "dtype": "bf16"}))
    zero = ZeroOptimizer(direct, torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2}, config={"stage": 1},
                         gradient_accumulation_steps=GAS)
    dtypes, returned = set(), []
    for step in range(2 * GAS):
        x, y = _batch(step, rank)
        out = engine(x)
        dtypes.add(out.dtype)
        loss = nn.functional.mse_loss(out.float(), y)
        returned.append((float(engine.backward(loss)), float(loss) / GAS))
        engine.step()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            reference = direct(x)
        zero.backward(nn.functional.mse_loss(reference.float(), y))
        zero.step()
        zero.zero_grad()
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), direct.parameters(), strict=True))
    engine.destroy()
    return dtypes, same, returned


def test_torch_autocast_runs_the_forward_in_its_dtype_and_trains_as_the_same_autocast_loop():
    for dtypes, same, returned in spawn(autocast_training, world_size=2):
        assert dtypes == {torch.bfloat16}  # the Linear's output under autocast
        assert same  # bit for bit the ZeRO loop whose forward ran under the same autocast
        assert all(got == want for got, want in returned)  # backward returns loss / gradient_accumulation_steps


def gc_and_log_level(rank, world_size):
    was = gc.isenabled()
    engine, *_ = ds_all.initialize(model=_model(), config=_config(disable_python_gc=True, log_level="ERROR"))
    during = gc.isenabled()
    collected = engine.collect_python_gc()
    levels = {name: logging.getLogger(name).level for name in ("DeepSpeed", "ds_all", "ds_zero")}
    engine.destroy()
    return was, during, isinstance(collected, int), gc.isenabled(), levels


def test_disable_python_gc_holds_the_collector_off_while_the_engine_lives_and_log_level_sets_the_loggers():
    for was, during, collected, after, levels in spawn(gc_and_log_level, world_size=2):
        assert was and not during and collected and after
        assert set(levels.values()) == {logging.ERROR}


def parallel_sizes(rank, world_size, config):
    try:
        ds_all.initialize(model=_model(), config=_config(**config))[0].destroy()
    except ValueError as e:
        return str(e)
    return None


def test_data_parallel_size_must_describe_the_ranks_when_the_mesh_is_given():
    assert spawn(parallel_sizes, world_size=2, args=({"data_parallel_size": 2, "sequence_parallel_size": 1},)) == \
        [None, None]
    for message in spawn(parallel_sizes, world_size=2, args=({"data_parallel_size": 4, "sequence_parallel_size": 1},)):
        assert "data_parallel_size 4 × sequence_parallel_size 1 must be the 2 data-parallel ranks" in message
    assert spawn(parallel_sizes, world_size=2, args=({"data_parallel_size": 4},)) == [None, None]  # alone: ignored


def eval_route(rank, world_size):
    engine, *_ = ds_all.initialize(model=_model(), config=_config())
    data = torch.utils.data.TensorDataset(torch.arange(16.0).unsqueeze(1))
    order = [float(x) for (batch,) in engine.deepspeed_io(data, route="eval") for x in batch.flatten()]
    shuffled = [float(x) for (batch,) in engine.deepspeed_io(data) for x in batch.flatten()]
    try:
        engine.deepspeed_io(data, route="test")
        error = None
    except ValueError as e:
        error = str(e)
    engine.destroy()
    return order, shuffled, error


def test_deepspeed_io_keeps_the_order_on_the_eval_route():
    for rank, (order, shuffled, error) in enumerate(spawn(eval_route, world_size=2)):
        assert order == [float(i) for i in range(rank, 16, 2)]  # DistributedSampler without shuffling
        assert sorted(shuffled) != shuffled and len(shuffled) == 8
        assert "route must be one of 'train', 'eval', 'predict', 'encode', got 'test'" in error


def refusals(rank, world_size, config):
    try:
        ds_all.initialize(model=_model(), config=_config(**config))[0].destroy()
    except (ValueError, NotImplementedError) as e:
        return str(e)
    return None


@pytest.mark.parametrize(("config", "words"), [
    ({"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["torch.nn.NoSuchLayer"]}},
     "torch_autocast.lower_precision_safe_modules: cannot import 'torch.nn.NoSuchLayer'"),
    ({"torch_autocast": {"enabled": True, "dtype": "fp16"}, "zero_optimization": {"stage": 0}},
     "torch_autocast with dtype fp16 at zero_optimization.stage 0 needs DeepSpeed's torch GradScaler"),
])
def test_autocast_settings_ds_cannot_honour_are_named(config, words):
    for message in spawn(refusals, world_size=2, args=(config,)):
        assert message is not None and words in message
