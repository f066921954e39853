"""The engine's device (issue 28): the choice of DeepSpeed's ``_set_distributed_vars`` through ds-ops'
accelerator seam (stand-in accelerators on the CPU), the model's move at initialize, pinned loaders,
``wall_clock_breakdown`` timed by device events, the device's random state in checkpoints; and, on a
GPU (``cuda`` tests, world size 1 over NCCL), training at ZeRO stages 0 and 2 in bf16 equal to plain
PyTorch on the GPU, checkpoints of device tensors, and a one-stage pipeline."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import ds_all
import ds_ops
from ds_all import _checkpoint, _data, _device, _timers
from ds_comm.testing import spawn

IN, HIDDEN, MICRO, STEPS = 8, 16, 4, 4

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CPU = {"DS_ACCELERATOR": "cpu"}  # the CPU variants keep to the CPU on a machine with a GPU too


class FakeAccelerator:
    """Answers as ds-ops' accelerator would for a device type this machine may not have."""

    def __init__(self, name: str, count: int = 1):
        self.name, self.count, self.current = name, count, None
        self.state, self.sets = torch.zeros(16, dtype=torch.uint8), 0

    def device_name(self, index=None):
        return self.name if index is None or self.name == "cpu" else f"{self.name}:{index}"

    def device_count(self):
        return self.count

    def set_device(self, index):
        self.current = index

    def get_rng_state(self):
        return self.state.clone()

    def set_rng_state(self, state):
        self.state, self.sets = state.clone(), self.sets + 1


# ------------------------------------------------------------------------------- the choice (CPU)
def test_the_engine_device_is_local_ranks_gpu_made_current_and_the_cpu_without_one():
    cpu = FakeAccelerator("cpu")
    assert _device.engine_device(3, cpu) == torch.device("cpu") and cpu.current is None
    gpu = FakeAccelerator("cuda", count=8)
    assert _device.engine_device(3, gpu) == torch.device("cuda", 3) and gpu.current == 3
    few = FakeAccelerator("cuda", count=2)  # more ranks than GPUs: as ds_comm.init_distributed picks
    assert _device.engine_device(3, few) == torch.device("cuda", 1) and few.current == 1
    with pytest.raises(ValueError, match="LOCAL_RANK must be an integer >= 0, got -1"):
        _device.engine_device(-1, gpu)


def test_the_seam_decides_when_no_accelerator_is_given(monkeypatch):
    monkeypatch.setattr(_device.ds_ops, "get_accelerator", lambda: FakeAccelerator("cuda", count=4))
    assert _device.engine_device(2) == torch.device("cuda", 2)
    assert ds_ops.get_accelerator().device_name() == "cuda"  # the module's attribute is what was patched
    monkeypatch.undo()
    assert _device.engine_device(2) == torch.device(ds_ops.get_accelerator().device_name(2))


def test_the_model_moves_whole_keeping_its_parameters_unless_zero_3_partitioned_it():
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    assert not _device.place_model(model, torch.device("cpu"))  # there already
    assert _device.place_model(model, torch.device("meta"))  # (to a GPU the Parameter objects stay: cuda tests)
    assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
    partitioned = nn.Linear(2, 3)
    partitioned.weight.ds_tensor = torch.zeros(3)  # what ds_zero.Init leaves: ZeRO places the shards
    assert _device.is_partitioned(partitioned) and not _device.is_partitioned(nn.Linear(2, 3))
    assert not _device.place_model(partitioned, torch.device("meta"))
    assert partitioned.weight.device.type == "cpu"


def engine_on_the_cpu(rank, world_size):
    model = _model()
    engine, *_ = ds_all.initialize(model=model, config=_config(0))
    out = (engine.device, engine.local_rank, {p.device for p in model.parameters()})
    engine.destroy()
    return out


def test_initialize_on_the_cpu_keeps_everything_on_the_cpu():
    for rank, (device, local_rank, devices) in enumerate(spawn(engine_on_the_cpu, world_size=2, env=CPU)):
        assert device == torch.device("cpu") and local_rank == rank and devices == {torch.device("cpu")}


def test_loaders_pin_their_batches_for_a_gpu_only(monkeypatch):
    dataset = torch.utils.data.TensorDataset(torch.randn(8, 2))

    def loader(pin: bool):
        return _data.loader(dataset, batch_size=2, num_replicas=1, rank=0, drop_last=False, pin_memory=pin,
                            data_sampler=None, collate_fn=None, num_workers=0)

    assert _data.pins_memory(FakeAccelerator("cuda")) and not _data.pins_memory(FakeAccelerator("cpu"))
    assert loader(True).pin_memory is (ds_ops.get_accelerator().device_name() != "cpu")
    monkeypatch.setattr(_data.ds_ops, "get_accelerator", lambda: FakeAccelerator("cuda"))
    assert loader(True).pin_memory is True and loader(False).pin_memory is False
    monkeypatch.setattr(_data.ds_ops, "get_accelerator", lambda: FakeAccelerator("cpu"))
    assert loader(True).pin_memory is False


# ---------------------------------------------------------------------------------- timers (CPU)
class DeviceClock:
    """A device whose work takes the time the test says: events read its clock when they are recorded
    and are done when the test says the work is."""

    def __init__(self):
        self.now, self.done_until, self.events = 0.0, float("inf"), []
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self):
                self.t = clock.now
                clock.events.append(self)

            def query(self):
                return self.t <= clock.done_until

            def synchronize(self):
                clock.done_until = max(clock.done_until, self.t)

            def elapsed_time(self, end):
                assert self.query() and end.query(), "elapsed_time of an event not done"
                return (end.t - self.t) * 1000.0

        self.Event = Event

    def use_host_timers(self):
        return False


def test_breakdown_timers_on_a_gpu_read_the_device_events_not_the_host_clock():
    device = DeviceClock()
    timers = _timers.Timers(device_events=True, accelerator=device)
    fwd = timers("fwd")
    fwd.start()
    device.now += 0.25  # 250 ms of device work, however long the host took to launch it
    fwd.stop()
    device.done_until = 0.0  # the next interval's work is not done yet: it waits to be read
    fwd.start()
    device.now += 0.5
    fwd.stop()
    assert len(fwd._recorded) == 1  # the first was read as soon as it was done; the second waits
    assert fwd.elapsed(reset=False) == pytest.approx(750.0)  # reading waits for the device
    fwd.start()
    device.now += 0.125
    assert fwd.elapsed(reset=True) == pytest.approx(875.0)  # a running interval counts up to now
    device.now += 0.125
    fwd.stop()
    assert fwd.elapsed() == pytest.approx(125.0)
    timers("allreduce").add(0.002)  # measured elsewhere, on the host
    assert timers("allreduce").elapsed() == pytest.approx(2.0)
    assert len(device.events) == 8


def test_breakdown_timers_on_the_cpu_and_without_breakdown_read_the_host_clock():
    assert _timers.Timers(device_events=True, accelerator=ds_ops.Accelerator("cpu"))._event is None
    assert _timers.Timers(device_events=False, accelerator=DeviceClock())._event is None
    assert _timers.Timers(device_events=True, accelerator=DeviceClock())._event is not None
    timer = _timers.Timers(device_events=True, accelerator=ds_ops.Accelerator("cpu"))("step")
    timer.start()
    timer.stop()
    assert timer.elapsed() >= 0.0 and not timer._recorded


# -------------------------------------------------------------------- the device's random state (CPU)
def device_rng_round_trip(rank, world_size, path):
    engine, *_ = ds_all.initialize(model=_model(), config=_config(2))
    _train(engine, range(1), "cpu")
    real = _checkpoint.ds_ops
    gpu = FakeAccelerator("cuda")
    _checkpoint.ds_ops = SimpleNamespace(get_accelerator=lambda: gpu)
    try:
        gpu.state = torch.arange(16, dtype=torch.uint8) + rank
        engine.save_checkpoint(path, tag="gpu")
        gpu.state = torch.zeros(16, dtype=torch.uint8)
        engine.load_checkpoint(path, tag="gpu")
        restored = gpu.state.tolist()
        _checkpoint.ds_ops = real  # a checkpoint of a CPU run (no device state) loads on a GPU run
        engine.save_checkpoint(path, tag="cpu")
        _checkpoint.ds_ops = SimpleNamespace(get_accelerator=lambda: gpu)
        gpu.sets = 0
        engine.load_checkpoint(path, tag="cpu")
        untouched = gpu.sets
    finally:
        _checkpoint.ds_ops = real
    engine.load_checkpoint(path, tag="gpu")  # and a GPU run's on the CPU: its device state is not read
    engine.destroy()
    return restored, untouched


def test_the_device_random_state_is_saved_and_restored_through_the_seam(tmp_path):
    results = spawn(device_rng_round_trip, world_size=2, args=(str(tmp_path),), env=CPU)
    for rank, (restored, untouched) in enumerate(results):
        assert restored == list(range(rank, rank + 16)) and untouched == 0


# -------------------------------------------------------------------------------- shared helpers
def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, 1))


def _config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 1000, "gradient_clipping": 0.0, **extra}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(MICRO, IN, generator=g), torch.randn(MICRO, 1, generator=g)


def _train(engine, steps, device_type: str, dtype=torch.float32) -> list[float]:
    losses = []
    for step in steps:
        x, y = _batch(step)  # the plain engine does not move inputs (DeepSpeed's does not either)
        loss = nn.functional.mse_loss(engine(x.to(device_type, dtype)).float(), y.to(device_type))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


# --------------------------------------------------------------------------------------- on a GPU
def bf16_trains_like_torch(rank, world_size, stage, device_type):
    """The engine (bf16: the model in bf16, float32 master weights stepped by torch's AdamW) against
    plain torch on the same device: the bf16 model's gradients stepped on a float32 copy, rounded back."""
    model = _model()
    params = list(model.parameters())
    reference = copy.deepcopy(model).to(device_type, torch.bfloat16)
    masters = [p.detach().float().requires_grad_(True) for p in reference.parameters()]
    optimizer = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.01)
    engine, *_ = ds_all.initialize(model=model, config=_config(stage, bf16={"enabled": True}))
    placed = (str(engine.device), sorted({str(p.device) for p in model.parameters()}),
              all(a is b for a, b in zip(params, model.parameters(), strict=True)))  # moved, the same Parameters
    losses = _train(engine, range(STEPS), device_type, torch.bfloat16)
    reference_losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(reference(x.to(device_type, torch.bfloat16)).float(), y.to(device_type))
        loss.backward()
        for master, p in zip(masters, reference.parameters(), strict=True):
            master.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for master, p in zip(masters, reference.parameters(), strict=True):
                p.copy_(master)
                p.grad = None
        reference_losses.append(float(loss.detach()))
    got = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    engine.destroy()
    want = {n: p.detach().float().cpu() for n, p in reference.named_parameters()}
    start = {n: p.detach().float() for n, p in _model().named_parameters()}
    return {"placed": placed, "losses": losses, "reference_losses": reference_losses,
            "diff": max(float((got[n] - want[n]).abs().max()) for n in want),
            "moved": max(float((want[n] - start[n]).abs().max()) for n in want)}


def _check_bf16(result: dict, device: str) -> None:
    assert result["placed"] == (device, [device], True)
    assert result["moved"] > 2e-2  # training moved the weights far beyond the tolerance
    assert result["diff"] <= 1e-2  # a few bf16 roundings of weights of magnitude < 1
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=2e-2, abs=1e-3)


@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_training_equals_torch_on_the_cpu(stage):
    (result,) = spawn(bf16_trains_like_torch, world_size=1, args=(stage, "cpu"), env=CPU)
    _check_bf16(result, "cpu")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_training_on_cuda_equals_torch_on_the_gpu(stage):
    (result,) = spawn(bf16_trains_like_torch, world_size=1, args=(stage, "cuda"), backend="nccl", timeout=300)
    _check_bf16(result, "cuda:0")  # initialize moved the model to LOCAL_RANK's GPU


def checkpoint_round_trip(rank, world_size, path, device_type):
    """Save after 2 steps, record the 3rd step's weights, disturb the device's random state, load,
    run the 3rd step again: the same weights, on the device, and the random state as saved."""
    model = _model()
    engine, *_ = ds_all.initialize(model=model, config=_config(2))
    _train(engine, range(2), device_type)
    rng = ds_ops.get_accelerator().get_rng_state().clone()
    engine.save_checkpoint(path, tag="t", client_state={"marker": torch.arange(3, device=device_type), "n": 1})
    _train(engine, range(2, 3), device_type)
    after = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(123)
    torch.rand(4, device=device_type)  # the random streams move on
    _, client = engine.load_checkpoint(path, tag="t")
    rng_restored = torch.equal(ds_ops.get_accelerator().get_rng_state(), rng)
    _train(engine, range(2, 3), device_type)
    again = [p.detach() for p in model.parameters()]
    engine.save_16bit_model(path, "model.bin")
    saved = torch.load(f"{path}/model.bin", weights_only=True)
    engine.destroy()
    return {"devices": sorted({str(p.device) for p in again}),
            "diff": max(float((a - b).abs().max()) for a, b in zip(after, again, strict=True)),
            "client": (str(client["marker"].device), client["marker"].tolist(), client["n"]),
            "rng_restored": rng_restored, "file_devices": sorted({str(t.device) for t in saved.values()})}


def _check_round_trip(result: dict, device: str) -> None:
    assert result["devices"] == [device] and result["diff"] <= 1e-6
    assert result["client"] == ("cpu", [0, 1, 2], 1)  # load_checkpoint hands back CPU tensors
    assert result["rng_restored"] and result["file_devices"] == ["cpu"]


def test_a_checkpoint_round_trip_on_the_cpu(tmp_path):
    (result,) = spawn(checkpoint_round_trip, world_size=1, args=(str(tmp_path), "cpu"), env=CPU)
    _check_round_trip(result, "cpu")


@pytest.mark.cuda
@cuda
def test_a_checkpoint_of_device_tensors_round_trips_on_cuda(tmp_path):
    (result,) = spawn(checkpoint_round_trip, world_size=1, args=(str(tmp_path), "cuda"), backend="nccl",
                      timeout=300)
    _check_round_trip(result, "cuda:0")


def pipeline_trains_like_torch(rank, world_size, device_type):
    """A one-stage PipelineEngine (ZeRO stage 0, float32) against the same layers trained by plain torch
    on the device: each micro-batch's loss / micro-batches, one AdamW step per batch."""
    from ds_pipe import PipelineModule

    micro_batches = 2
    layers = list(_model())
    reference = nn.Sequential(*copy.deepcopy(layers)).to(device_type)
    module = PipelineModule(layers, num_stages=1, loss_fn=nn.functional.mse_loss, partition_method="uniform")
    config = {**_config(0), "gradient_accumulation_steps": micro_batches}
    engine, *_ = ds_all.initialize(model=module, config=config)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    losses, reference_losses = [], []
    for step in range(STEPS):
        data = [_batch(10 * step + m) for m in range(micro_batches)]  # on the host: the stage moves them
        losses.append(float(engine.train_batch(iter(data))))
        total = 0.0
        for x, y in data:
            loss = nn.functional.mse_loss(reference(x.to(device_type)), y.to(device_type))
            (loss / micro_batches).backward()
            total += float(loss.detach()) / micro_batches
        optimizer.step()
        optimizer.zero_grad()
        reference_losses.append(total)
    got = [p.detach() for p in module.parameters()]
    result = {"devices": sorted({str(p.device) for p in got}), "engine": str(engine.device),
              "losses": losses, "reference_losses": reference_losses,
              "diff": max(float((a - b).abs().max()) for a, b in zip(got, reference.parameters(), strict=True))}
    engine.destroy()
    return result


def _check_pipeline(result: dict, device: str) -> None:
    assert result["devices"] == [device] and result["engine"] == device
    assert result["diff"] <= 1e-5
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-4)


def test_a_one_stage_pipeline_engine_trains_like_torch_on_the_cpu():
    (result,) = spawn(pipeline_trains_like_torch, world_size=1, args=("cpu",), env=CPU)
    _check_pipeline(result, "cpu")


@pytest.mark.cuda
@cuda
def test_a_one_stage_pipeline_engine_trains_on_cuda_like_torch_on_the_gpu():
    (result,) = spawn(pipeline_trains_like_torch, world_size=1, args=("cuda",), backend="nccl", timeout=300)
    _check_pipeline(result, "cuda:0")
