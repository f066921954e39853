"""ds_all.initialize and the engine on 2 ranks: the engine's training equals ds-zero used directly
(and DDP at stage 0) bit for bit; client optimizers and schedules, the config's optimizer and
scheduler, the data loader's split, gradient accumulation boundaries, fp16 overflow skipping the
schedule, and every refusal named."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
from torch import nn

import ds_all
import ds_comm
from ds_comm.testing import spawn
from ds_zero import ZeroOptimizer

IN, HIDDEN = 8, 16
MICRO, GAS, STEPS = 4, 2, 5


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, 1))


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(MICRO, IN, generator=g), torch.randn(MICRO, 1, generator=g)


def _zero_section(stage: int) -> dict:
    # stage 3: every module partitioned (DeepSpeed's default threshold keeps modules this small whole)
    return {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}


def _config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": _zero_section(stage), "steps_per_print": 1000,
            "gradient_clipping": 0.0, **extra}  # unclipped unless a test asks (DeepSpeed's default: 1.0)


def engine_matches_zero_and_ddp(rank, world_size, stage):
    model = _model()
    direct, ddp_model = copy.deepcopy(model), copy.deepcopy(model)
    engine, optimizer, loader, scheduler = ds_all.initialize(model=model, config=_config(stage, gradient_clipping=1.0))
    assert loader is None and scheduler is None and optimizer is engine.optimizer
    zero = ZeroOptimizer(direct, torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.01},
                         config=_zero_section(stage), gradient_clipping=1.0, gradient_accumulation_steps=GAS)
    ddp = nn.parallel.DistributedDataParallel(ddp_model)
    reference = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01)
    boundaries = []
    for step in range(STEPS):
        for micro in range(GAS):
            x, y = _batch(step, micro, rank)
            boundaries.append(engine.is_gradient_accumulation_boundary())
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
            zero.backward(nn.functional.mse_loss(direct(x), y))
            zero.step()
            zero.zero_grad()
            with ddp.no_sync() if micro < GAS - 1 else torch.enable_grad():
                (nn.functional.mse_loss(ddp(x), y) / GAS).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        reference.step()
        reference.zero_grad()
    assert boundaries == [False, True] * STEPS
    assert engine.global_steps == STEPS and engine.micro_steps == STEPS * GAS
    assert engine.global_samples == STEPS * GAS * MICRO * world_size
    engine.destroy()  # stage 3: every parameter whole again
    zero.close()
    same_as_zero = all(torch.equal(a, b) for a, b in zip(model.parameters(), direct.parameters(), strict=True))
    same_as_ddp = all(torch.equal(a, b) for a, b in zip(model.parameters(), ddp_model.parameters(), strict=True))
    close_to_ddp = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(model.parameters(), ddp_model.parameters(),
                                                                         strict=True))
    return same_as_zero, same_as_ddp, close_to_ddp


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_engine_trains_exactly_as_ds_zero_direct(stage):
    for same_as_zero, same_as_ddp, close_to_ddp in spawn(engine_matches_zero_and_ddp, world_size=2, args=(stage,)):
        assert same_as_zero
        assert close_to_ddp
        if stage == 0:  # DDP's arithmetic; stages 1-2 sum the clipping norm from pieces (ds-zero's README)
            assert same_as_ddp


def _reference_step(twin, reference, schedule, step, world_size):
    """The reference: the mean of every rank's gradients, stepped by torch alone."""
    reference.zero_grad()
    for r in range(world_size):
        xr, yr = _batch(step, 0, r)
        (nn.functional.mse_loss(twin(xr), yr) / world_size).backward()
    reference.step()
    schedule.step()


def client_optimizer_and_schedule(rank, world_size, kind):
    model, twin = _model(), _model()
    client = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    ref_schedule = torch.optim.lr_scheduler.StepLR(reference, step_size=2, gamma=0.5)
    if kind == "object":
        schedule = torch.optim.lr_scheduler.StepLR(client, step_size=2, gamma=0.5)
    else:
        def schedule(optimizer):
            return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    config = {"train_batch_size": MICRO * world_size, "zero_optimization": {"stage": 1}, "gradient_clipping": 0}
    engine, optimizer, _, scheduler = ds_all.initialize(model=model, optimizer=client, lr_scheduler=schedule,
                                                        config=config)
    assert optimizer.optimizer is client  # rebound to ZeRO's buffers, the same object
    lrs = []
    for step in range(STEPS):
        x, y = _batch(step, 0, rank)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        lrs.append(engine.get_lr()[0])
        _reference_step(twin, reference, ref_schedule, step, world_size)
    close = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    engine.destroy()
    return lrs, close, type(scheduler).__name__


@pytest.mark.parametrize("kind", ["object", "callable"])
def test_a_client_optimizer_and_schedule_drive_zero(kind):
    for lrs, close, name in spawn(client_optimizer_and_schedule, world_size=2, args=(kind,)):
        assert lrs == [0.1, 0.05, 0.05, 0.025, 0.025]
        assert close
        assert name == "StepLR"


def _groups(model: nn.Module) -> list[dict]:
    """A client's groups: the first layer without weight decay and with a learning rate of its own."""
    return [{"params": list(model[0].parameters()), "weight_decay": 0.0, "lr": 0.05},
            {"params": [p for layer in list(model)[1:] for p in layer.parameters()], "weight_decay": 0.1}]


def groups_drive_zero(rank, world_size, kind):
    model, twin = _model(), _model()
    reference = torch.optim.AdamW(_groups(twin), lr=1e-2)
    ref_schedule = torch.optim.lr_scheduler.StepLR(reference, step_size=2, gamma=0.5)

    def schedule(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    config = {"train_batch_size": MICRO * world_size, "zero_optimization": {"stage": 2}, "gradient_clipping": 0}
    if kind == "client optimizer":
        client = torch.optim.AdamW(_groups(model), lr=1e-2)
        engine, optimizer, _, _ = ds_all.initialize(model=model, optimizer=client, lr_scheduler=schedule, config=config)
        assert optimizer.optimizer is client
    else:  # the config's optimizer over the client's model_parameters groups, as DeepSpeed builds it
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}
        engine, *_ = ds_all.initialize(model=model, model_parameters=_groups(model), lr_scheduler=schedule,
                                       config=config)
    lrs = []
    for step in range(STEPS):
        x, y = _batch(step, 0, rank)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        lrs.append(engine.get_lr())
        _reference_step(twin, reference, ref_schedule, step, world_size)
    decay = [g["weight_decay"] for g in engine.optimizer.param_groups]
    error = max((a - b).abs().max().item() for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    engine.destroy()
    return lrs, decay, error


@pytest.mark.parametrize("kind", ["client optimizer", "model_parameters"])
def test_parameter_groups_keep_their_options_under_zero(kind):
    for lrs, decay, error in spawn(groups_drive_zero, world_size=2, args=(kind,)):
        assert lrs == [[0.05, 0.01], [0.025, 0.005], [0.025, 0.005], [0.0125, 0.0025], [0.0125, 0.0025]]
        assert decay == [0.0, 0.1]
        assert error < 1e-6


def config_schedule_and_data(rank, world_size):
    data = torch.utils.data.TensorDataset(torch.arange(80, dtype=torch.float32).view(80, 1).repeat(1, IN),
                                          torch.arange(80, dtype=torch.float32).view(80, 1))
    config = _config(2, scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                                   "warmup_num_steps": 4, "warmup_type": "linear"}})
    engine, _, loader, scheduler = ds_all.initialize(model=_model(), config=config, training_data=data)
    seen, lrs = [], []
    for x, y in loader:
        assert x.shape == (MICRO, IN)
        seen += y.flatten().int().tolist()
        engine.backward(nn.functional.mse_loss(engine(x / 80), y / 80))
        engine.step()
        if engine.micro_steps % GAS == 0:
            lrs.append(engine.get_lr()[0])
    engine.destroy()
    return seen, lrs, type(scheduler).__name__


def test_the_config_schedule_steps_at_boundaries_and_the_loader_splits_the_data():
    (seen0, lrs, name), (seen1, lrs1, _) = spawn(config_schedule_and_data, world_size=2)
    assert name == "WarmupLR"
    assert sorted(seen0 + seen1) == list(range(80)) and not set(seen0) & set(seen1)
    # 40 samples per rank: 10 micro-batches, 5 boundaries; after the k-th boundary's step the schedule
    # is at iteration k-1: linear warmup 1e-2 * (k-1) / 4, DeepSpeed's WarmupLR
    assert lrs == lrs1 == [0.0, 2.5e-3, 5e-3, 7.5e-3, 1e-2]


def fp16_overflow_skips_the_schedule(rank, world_size):
    config = _config(1, fp16={"enabled": True, "initial_scale_power": 4, "loss_scale_window": 1000, "hysteresis": 1},
                     scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 10,
                                                               "warmup_type": "linear"}},
                     gradient_accumulation_steps=1)
    engine, _, _, _ = ds_all.initialize(model=_model(), config=config)
    applied, scales, lrs = [], [], []
    for step in range(3):
        x, y = _batch(step, 0, rank)
        loss = nn.functional.mse_loss(engine(x.half()).float(), y)
        engine.backward(loss * (float("inf") if step == 1 else 1.0))
        engine.step()
        applied.append(engine.was_step_applied())
        scales.append(engine.optimizer.loss_scale)  # the current scale (engine.loss_scale() is the config's)
        lrs.append(engine.get_lr()[0])
    result = applied, scales, lrs, engine.skipped_steps, engine.global_steps
    engine.destroy()
    return result


def test_an_fp16_overflow_skips_the_step_and_the_schedule():
    for applied, scales, lrs, skipped, steps in spawn(fp16_overflow_skips_the_schedule, world_size=2):
        assert applied == [True, False, True]
        assert scales == [16.0, 8.0, 8.0]
        assert lrs == [0.0, 0.0, 1e-3]  # the schedule did not step at the skipped step
        assert (skipped, steps) == (1, 3)


def refusals(rank, world_size):
    model = _model()
    messages = {}

    def refused(name, call, error=ValueError):
        try:
            call()
        except error as e:
            messages[name] = str(e)
        else:
            messages[name] = "NOT REFUSED"

    config = _config(1)
    refused("no config", lambda: ds_all.initialize(model=model))
    refused("two configs", lambda: ds_all.initialize(model=model, config=config, config_params=config))
    args = argparse.Namespace(deepspeed_config="x.json")
    refused("args and config", lambda: ds_all.initialize(args=args, model=model, config=config))
    refused("not a model", lambda: ds_all.initialize(model="model", config=config))
    refused("foreign parameters", lambda: ds_all.initialize(model=_model(), config=_config(1, optimizer=None),
                                                            optimizer=torch.optim.SGD(_model().parameters(), lr=1)))
    refused("auto", lambda: ds_all.initialize(model=_model(), config={**config, "gradient_clipping": "auto"}))
    refused("schedule without optimizer", lambda: ds_all.initialize(
        model=_model(), config=_config(1, optimizer=None, scheduler={"type": "WarmupLR", "params": {}})))
    engine, *_ = ds_all.initialize(model=_model(), config=_config(0, optimizer=None))
    refused("backward without optimizer", lambda: engine.backward(torch.ones(())), RuntimeError)
    return messages


def test_bad_input_is_refused_by_name():
    messages = spawn(refusals, world_size=2)[0]
    assert "no DeepSpeed config" in messages["no config"]
    assert "config and config_params are both given" in messages["two configs"]
    assert "args.deepspeed_config ('x.json')" in messages["args and config"]
    assert "model must be a torch.nn.Module, got str" in messages["not a model"]
    assert "hold 0 of the model's 6 trainable parameters and 6 others" in messages["foreign parameters"]
    assert "gradient_clipping" in messages["auto"] and "auto" in messages["auto"]
    assert "a learning-rate schedule needs an optimizer" in messages["schedule without optimizer"]
    assert "this engine has no optimizer" in messages["backward without optimizer"]


def test_add_config_arguments_reads_deepspeed_flags():
    parser = ds_all.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "a.json"])
    assert args.deepspeed is True and args.deepspeed_config == "a.json"
    assert parser.parse_args(["--ds_config", "b.json"]).deepspeed_config == "b.json"
    assert parser.parse_args([]).deepspeed is False
    with pytest.raises(ValueError, match=r"must be an argparse\.ArgumentParser, got dict"):
        ds_all.add_config_arguments({})


def no_process_group_no_init(rank, world_size):
    ds_comm.destroy_process_group()
    try:
        ds_all.initialize(model=_model(), config=_config(0), dist_init_required=False)
    except RuntimeError as e:
        return str(e)
    return "NOT REFUSED"


def test_dist_init_required_false_without_a_group_is_refused():
    for message in spawn(no_process_group_no_init, world_size=2):
        assert "dist_init_required=False but no process group exists" in message


def save_16bit(rank, world_size, path, gather):
    model = _model()
    zero = {**_zero_section(3), "stage3_gather_16bit_weights_on_model_save": gather}
    engine, *_ = ds_all.initialize(model=model, config=_config(3, zero_optimization=zero, bf16={"enabled": True}))
    for step in range(2):
        for micro in range(GAS):
            x, y = _batch(step, micro, rank)
            engine.backward(nn.functional.mse_loss(engine(x.bfloat16()).float(), y))
            engine.step()
    saved = engine.save_16bit_model(path, "model.bin")
    engine.destroy()  # every parameter whole again, to compare with the file
    return saved, {k: v.tolist() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("gather", [True, False])
def test_save_16bit_model_gathers_the_partitioned_weights_on_rank_0(tmp_path, gather):
    results = spawn(save_16bit, world_size=2, args=(str(tmp_path), gather))
    assert [saved for saved, _ in results] == [gather, gather]
    if not gather:  # DeepSpeed's behaviour: a warning, nothing written, False
        assert not (tmp_path / "model.bin").exists()
        return
    state = torch.load(tmp_path / "model.bin", weights_only=True)
    whole = results[0][1]
    assert sorted(state) == sorted(whole)
    for name, tensor in state.items():
        assert tensor.dtype == torch.bfloat16 and tensor.tolist() == whole[name], name
