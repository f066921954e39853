"""The 1-bit optimizers through the engine's config: ``optimizer.type`` OneBitAdam / ZeroOneAdam / OneBitLamb train
exactly as ds-zero's ZeroOptimizer with the same optimizer; after warm-up a step sends >= 20x fewer
bytes than Adam's fp32 all-reduce (the comms logger's own counts), and 0/1 Adam's local steps send
nothing; ZeRO stages 1-3 and pipelines are refused naming the key."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ds_all
import ds_comm
from ds_comm.testing import spawn
from ds_zero import OneBitAdam, OneBitLamb, ZeroOneAdam, ZeroOptimizer

STEPS, WIDTH = 8, 96
ONEBIT = {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 3, "comm_backend_name": "gloo"}}
ZEROONE = {"type": "ZeroOneAdam", "params": {"lr": 1e-3, "var_freeze_step": 4, "var_update_scaler": 1,
                                             "local_step_scaler": 1, "local_step_clipper": 2}}
LAMB = {"type": "OneBitLamb", "params": {"lr": 1e-3, "freeze_step": 3, "weight_decay": 0.01}}
ADAM = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, 1, generator=g)


def _config(optimizer: dict, stage: int = 0) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": optimizer, "zero_optimization": {"stage": stage},
            "steps_per_print": 1000, "comms_logger": {"enabled": True}}


def engine_vs_direct(rank, world_size, section):
    model = _model()
    direct = copy.deepcopy(model)
    engine, *_ = ds_all.initialize(model=model, config=_config(section))
    cls = {"OneBitAdam": OneBitAdam, "ZeroOneAdam": ZeroOneAdam, "OneBitLamb": OneBitLamb}[section["type"]]
    options = {k: v for k, v in section["params"].items() if k != "comm_backend_name"}
    # the engine clips at DeepSpeed's default gradient_clipping, 1.0 (each rank its local gradients)
    zero = ZeroOptimizer(direct, lambda tensors: cls(tensors, **options), config={"stage": 0}, gradient_clipping=1.0)
    sent = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        ds_comm.comms_logger.reset()
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        sent.append(sum(r.bus_bytes for r in ds_comm.comms_logger.records()))
        zero.backward(nn.functional.mse_loss(direct(x), y))
        zero.step()
        zero.zero_grad()
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), direct.parameters(), strict=True))
    kind = type(engine.optimizer.optimizer).__name__
    engine.destroy()
    zero.close()
    return same, sent, kind


def adam_bytes(rank, world_size):
    engine, *_ = ds_all.initialize(model=_model(), config=_config(ADAM))
    x, y = _batch(0, rank)
    ds_comm.comms_logger.reset()
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    sent = sum(r.bus_bytes for r in ds_comm.comms_logger.records())
    engine.destroy()
    return sent


@pytest.fixture(scope="module")
def adam_step_bytes():
    return spawn(adam_bytes, world_size=2)[0]


@pytest.mark.parametrize("section", [ONEBIT, LAMB], ids=["OneBitAdam", "OneBitLamb"])
def test_one_bit_adam_and_lamb_from_the_config_send_20x_fewer_bytes_after_warm_up(adam_step_bytes, section):
    for same, sent, kind in spawn(engine_vs_direct, world_size=2, args=(section,)):
        assert kind == section["type"] and same
        assert all(b == pytest.approx(adam_step_bytes, rel=0.01) for b in sent[:3])  # warm-up: Adam's all-reduce
        assert all(adam_step_bytes / b >= 20 for b in sent[3:]), (adam_step_bytes, sent)


def test_zero_one_adam_skips_communication_on_local_steps(adam_step_bytes):
    for same, sent, kind in spawn(engine_vs_direct, world_size=2, args=(ZEROONE,)):
        assert kind == "ZeroOneAdam" and same
        # var_update_scaler 1: variance steps at 1, 2, 4 (interval doubling each time), a 1-bit gradient
        # at step 3; frozen after 4; local steps 5-8 at intervals 1, 2, 2, 2 (clipped): syncs at 5, 6, 8
        full, compressed, silent = ([i + 1 for i, b in enumerate(sent) if test(b)] for test in (
            lambda b: b >= adam_step_bytes * 0.99, lambda b: 0 < b <= adam_step_bytes / 20, lambda b: b == 0))
        assert (full, compressed, silent) == ([1, 2, 4], [3, 5, 6, 8], [7]), sent


def refusals(rank, world_size):
    from ds_all.pipe import PipelineModule

    out = {}
    for name, call in (
        ("stage 2", lambda: ds_all.initialize(model=_model(), config=_config(ONEBIT, stage=2))),
        ("pipeline", lambda: ds_all.initialize(model=PipelineModule(list(_model()), num_stages=2,
                                                                    loss_fn=nn.functional.mse_loss),
                                               config={**_config(ZEROONE), "gradient_accumulation_steps": 2})),
    ):
        try:
            call()
            out[name] = "NOT REFUSED"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_zero_stages_above_0_and_pipelines_are_refused_naming_the_key():
    out = spawn(refusals, world_size=2)[0]
    assert "optimizer.type OneBitAdam runs with zero_optimization.stage 0 only" in out["stage 2"]
    assert "got stage 2" in out["stage 2"]
    assert "optimizer.type ZeroOneAdam does not train a PipelineModule" in out["pipeline"]
