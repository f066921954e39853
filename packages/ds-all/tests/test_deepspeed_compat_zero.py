"""What DeepSpeed's ZeRO unit tests rely on, on 2 ranks: a client optimizer and schedule override the
config's sections (with one warning naming both), parameter groups that hold only some trainable
parameters train those (the others keep their values, through a checkpoint too), an odd
allgather_bucket_size, and the names those tests read (attributes of the wrapped model through the
engine, fp16_groups, nccl_start_alignment_factor, ds_persist, BF16_Optimizer, ZeRORuntimeException)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import ds_all
from ds_comm.testing import spawn

IN = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, IN), nn.Tanh(), nn.Linear(IN, IN), nn.Tanh(), nn.Linear(IN, 1))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, IN, generator=g), torch.randn(4, 1, generator=g)


def _config(stage: int, **extra) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    # no clipping (DeepSpeed's default clips at 1.0): the references are torch's unclipped steps
    return {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero, "steps_per_print": 1000,
            "gradient_clipping": 0.0, **extra}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def client_overrides_config(rank, world_size):
    records = _Records()
    logging.getLogger("ds_all").addHandler(records)
    model = _model()
    reference = copy.deepcopy(model)
    config = _config(1, optimizer={"type": "Adam", "params": {"lr": 1.0}},
                     scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}})
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, optimizer, _, scheduler = ds_all.initialize(
        model=model, config=config, optimizer=client,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    plain = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    for step in range(3):
        x, y = _batch(step, rank)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        sgd.zero_grad()
        losses = [nn.functional.mse_loss(reference(xr), yr) for xr, yr in (_batch(step, r) for r in range(world_size))]
        (sum(losses) / world_size).backward()
        sgd.step()
        plain.step()
    close = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), reference.parameters(),
                                                                strict=True))
    result = (type(scheduler).__name__, engine.get_lr(), close and optimizer.optimizer is client,
              engine.optimizer_name(), records.messages)
    logging.getLogger("ds_all").removeHandler(records)
    engine.destroy()
    return result


def test_a_client_optimizer_and_schedule_override_the_config_sections_with_a_warning():
    results = spawn(client_overrides_config, world_size=2)
    for name, lrs, close, optimizer_name, _ in results:
        assert name == "StepLR" and lrs == [0.1 * 0.5 ** 3] and close and optimizer_name == "SGD"
    warnings = results[0][4]  # rank 0 logs
    assert any("optimizer passed (SGD)" in m and "'optimizer' section (type 'Adam')" in m for m in warnings), warnings
    assert any("lr_scheduler passed" in m and "'scheduler' section (type 'WarmupLR')" in m for m in warnings), warnings
    assert results[1][4] == []


def groups_cover_some(rank, world_size, stage, how):
    model = _model()
    reference = copy.deepcopy(model)
    third = [p.detach().clone() for p in model[4].parameters()]
    chosen = [*model[0].parameters(), *model[2].parameters()]
    kwargs = {}
    if how == "optimizer":
        kwargs["optimizer"] = torch.optim.AdamW([{"params": chosen}, {"params": []}], lr=1e-2, weight_decay=0.1)
    else:
        kwargs["model_parameters"] = [{"params": chosen}, {"params": []}]
    config = _config(stage) if how == "optimizer" else \
        _config(stage, optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}})
    engine, *_ = ds_all.initialize(model=model, config=config, **kwargs)
    ref_chosen = [*reference[0].parameters(), *reference[2].parameters()]
    adamw = torch.optim.AdamW(ref_chosen, lr=1e-2, weight_decay=0.1)
    for step in range(3):
        x, y = _batch(step, rank)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        adamw.zero_grad()
        losses = [nn.functional.mse_loss(reference(xr), yr) for xr, yr in (_batch(step, r) for r in range(world_size))]
        (sum(losses) / world_size).backward()
        adamw.step()
    with ds_all.zero.GatheredParameters(list(model.parameters())):
        trained = [p.detach().clone() for p in model.parameters()]
    engine.destroy()
    expected = [p.detach() for p in reference.parameters()]
    return ([torch.allclose(a, b, atol=1e-5) for a, b in zip(trained, expected, strict=True)],
            [torch.equal(a, b) for a, b in zip(trained[4:], third, strict=True)],
            [not torch.equal(a, b) for a, b in zip(trained[:4], [p.detach() for p in _model().parameters()][:4],
                                                   strict=True)])


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("how", ["optimizer", "model_parameters"])
def test_groups_over_some_parameters_train_those_and_leave_the_others(stage, how):
    for close, untouched, moved in spawn(groups_cover_some, world_size=2, args=(stage, how)):
        assert all(close) and all(untouched) and all(moved), (close, untouched, moved)


def names_deepspeed_tests_read(rank, world_size, stage):
    model = _model()
    model.custom_attribute = "mine"
    model.twice = lambda value: 2 * value
    reference = copy.deepcopy(model)
    zero = {"stage": stage, "allgather_bucket_size": 7}  # odd: DeepSpeed's ZeRO-1/2 assert a multiple of 2
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 20  # the last Linear (7 elements) only
    config = _config(stage, zero_optimization=zero,
                     optimizer={"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}})
    engine, optimizer, *_ = ds_all.initialize(model=model, config=config)
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(2):
        x, y = _batch(step, rank)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        adamw.zero_grad()
        losses = [nn.functional.mse_loss(reference(xr), yr) for xr, yr in (_batch(step, r) for r in range(world_size))]
        (sum(losses) / world_size).backward()
        adamw.step()
    with ds_all.zero.GatheredParameters(list(model.parameters())):
        close = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(model.parameters(), reference.parameters(),
                                                                    strict=True))
    out = {
        "close": close,
        "passthrough": (engine.custom_attribute, engine.twice(3), engine.training),
        "missing": _attribute_error(lambda: engine.no_such_attribute),
        "groups": [[id(p) for p in group] for group in optimizer.fp16_groups] ==
                  [[id(p) for p in model.parameters()]],
        "bit16": optimizer.bit16_groups == optimizer.fp16_groups,
        "alignment": optimizer.nccl_start_alignment_factor,
        "persist": [getattr(p, "ds_persist", None) for p in model.parameters()],
    }
    engine.destroy()
    return out


def _attribute_error(read) -> str:
    try:
        read()
    except AttributeError as e:
        return str(e)
    return "NOT RAISED"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_names_deepspeed_zero_tests_read_and_an_odd_allgather_bucket_size(stage):
    for out in spawn(names_deepspeed_tests_read, world_size=2, args=(stage,)):
        assert out["close"]  # an odd allgather_bucket_size trains as torch's AdamW does
        assert out["passthrough"] == ("mine", 6, True)
        assert out["missing"] == "'DeepSpeedEngine' object has no attribute 'no_such_attribute'"
        assert out["groups"] and out["bit16"] and out["alignment"] == 1
        if stage == 3:  # per unit (a module's parameters): the 7-element last Linear is under the threshold
            assert out["persist"] == [False, False, False, False, True, True]
        else:
            assert out["persist"] == [None] * 6


def bf16_engine(rank, world_size):
    from ds_all.runtime.bf16_optimizer import BF16_Optimizer

    engine, optimizer, *_ = ds_all.initialize(
        model=_model(), config=_config(0, bf16={"enabled": True},
                                       optimizer={"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}))
    result = isinstance(optimizer, BF16_Optimizer) and isinstance(engine.optimizer, BF16_Optimizer)
    engine.destroy()
    return result


def test_bf16_optimizer_is_ds_zeros_optimizer():
    assert all(spawn(bf16_engine, world_size=2))


def test_zero_runtime_exception_is_a_runtime_error_under_deepspeeds_path():
    import ds_zero
    from ds_all.runtime.zero.utils import ZeRORuntimeException

    assert ZeRORuntimeException is ds_zero.ZeRORuntimeException and issubclass(ZeRORuntimeException, RuntimeError)
    with pytest.raises(ZeRORuntimeException, match="x"):
        raise ZeRORuntimeException("x")


def checkpoint_with_left_out(rank, world_size, path):
    def build():
        model = _model()
        chosen = [*model[0].parameters(), *model[2].parameters()]
        engine, *_ = ds_all.initialize(model=model, config=_config(2),
                                       optimizer=torch.optim.AdamW([{"params": chosen}], lr=1e-2))
        return model, engine

    model, engine = build()
    for step in range(2):
        x, y = _batch(step, rank)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    engine.save_checkpoint(path, tag="t")
    saved = [p.detach().clone() for p in model.parameters()]
    engine.destroy()
    other, again = build()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)  # every value differs until loaded
    again.load_checkpoint(path, tag="t")
    loaded = [torch.equal(a, b) for a, b in zip(other.parameters(), saved, strict=True)]
    again.destroy()
    return loaded


def test_a_checkpoint_keeps_the_parameters_in_no_group(tmp_path):
    for loaded in spawn(checkpoint_with_left_out, world_size=2, args=(str(tmp_path / "ck"),)):
        assert all(loaded), loaded


def allreduce_after_backward(rank, world_size, stage):
    trained = []
    for call in (False, True):
        model = _model()
        engine, *_ = ds_all.initialize(model=model, config=_config(stage, optimizer={"type": "AdamW",
                                                                                     "params": {"lr": 1e-2}}))
        for step in range(3):
            x, y = _batch(step, rank)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            if call:
                engine.allreduce_gradients()  # DeepSpeed's tests call it after backward: nothing changes
            engine.step()
        with ds_all.zero.GatheredParameters(list(model.parameters())):
            trained.append([p.detach().clone() for p in model.parameters()])
        engine.destroy()
    return all(torch.equal(a, b) for a, b in zip(*trained, strict=True))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_allreduce_gradients_after_backward_leaves_training_as_it_is(stage):
    assert spawn(allreduce_after_backward, world_size=2, args=(stage,)) == [True, True]
