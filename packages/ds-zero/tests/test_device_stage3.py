"""Stage 3 on the model's device: gather buffers there, ZeRO-3 parameter offload (``offload_param: cpu``)
copying each shard from the host partition up to the gather buffer, prefetched copies staged ahead.

On the CPU (2 ranks, gloo) the host partition is apart from the gather buffers and every copy really
happens: each gather copies exactly this rank's shard (bytes counted per forward and backward), a
`GatheredParameters` write copies it back down, and training, inference and frozen parameters are bit
for bit what they are without the offload. The tests marked ``cuda`` (one GPU, world size 1, NCCL; run
by scripts/gpu_check.sh) train a tiny model at stage 3 on the GPU in fp32 and bf16, with and without
the offload, against plain torch AdamW on the GPU; build it under `Init` on the GPU; and run
`ZeroInference` there."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ds_comm.testing import spawn
from ds_zero import GatheredParameters, Init, ZeroInference, ZeroOptimizer
from ds_zero._stage3_offload import partition_buffer
from ds_zero.config import ZeroConfig

WIDTH = 16
UNIT = WIDTH * WIDTH + WIDTH  # one Linear(16, 16): weight and bias, one fetch unit
ADAMW = {"lr": 1e-2, "weight_decay": 0.01}
# no persistent unit: every unit is gathered (and its shard copied up) each time a module runs
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
OFFLOAD = {"offload_param": {"device": "cpu"}}


class Stack(nn.Module):
    """Four Linear(16, 16) layers: four fetch units of one size."""

    def __init__(self, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _batch(step: int, rank: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, WIDTH, generator=g).to(device)


def _train(model, zero, steps, rank, device="cpu", dtype=torch.float32):
    losses = []
    for step in range(steps):
        loss = model(_batch(step, rank, device).to(dtype)).float().pow(2).mean()
        zero.backward(loss)
        zero.step()
        zero.zero_grad()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------------------------------- CPU, 2 ranks
def copies_counted(rank, world_size):
    torch.manual_seed(0)
    model = Stack()
    # reuse distance 0: a unit is kept after its forward only when the very next request is its own
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW,
                         config={**STAGE3, **OFFLOAD, "stage3_max_reuse_distance": 0})
    stage3 = zero._stage3
    shard_bytes = [unit.bucket.shard * 4 for unit in stage3.units]
    out = {"shards": [unit.bucket.shard for unit in stage3.units], "host": stage3.mover.host,
           "apart": all(p.ds_tensor.untyped_storage().data_ptr() == zero._flat.untyped_storage().data_ptr()
                        for p in model.parameters()),
           "start": (stage3.transfers.up_copies, stage3.transfers.up_bytes)}
    seen = []

    def inside(module, args, output):  # while a layer runs: its parameters are a gather buffer's views
        seen.append(all(p.untyped_storage().data_ptr() != zero._flat.untyped_storage().data_ptr()
                        for p in module.parameters()))
    handles = [layer.register_forward_hook(inside) for layer in model.layers]
    staged = []
    stage = stage3.mover.stage
    stage3.mover.stage = lambda shard, mine: (staged.append(shard.numel()), stage(shard, mine))[1]
    phases = []
    for step in range(3):
        before = (stage3.gathers, stage3.transfers.up_copies, stage3.transfers.up_bytes)
        loss = model(_batch(step, rank)).pow(2).mean()
        forward = (stage3.gathers, stage3.transfers.up_copies, stage3.transfers.up_bytes)
        zero.backward(loss)
        backward = (stage3.gathers, stage3.transfers.up_copies, stage3.transfers.up_bytes)
        zero.step()
        zero.zero_grad()
        phases.append((before, forward, backward))
    for handle in handles:
        handle.remove()
    out.update(phases=phases, shard_bytes=shard_bytes, seen=seen, staged=staged,
               down=(stage3.transfers.down_copies, stage3.transfers.down_bytes))
    # a write inside GatheredParameters goes back down to the host partition (one shard)
    with GatheredParameters(list(model.layers[0].parameters()), modifier_rank=0):
        if rank == 0:
            model.layers[0].bias.data.fill_(3.0)
    out["written"] = (stage3.transfers.down_copies, stage3.transfers.down_bytes)
    out["bias"] = model.layers[0].bias.ds_tensor.tolist()
    out["check group"] = dist.get_backend(stage3._check_group)
    zero.close()
    return out


def test_parameter_offload_copies_each_shard_up_once_per_gather_with_exact_bytes():
    for rank, out in enumerate(spawn(copies_counted, world_size=2)):
        assert out["host"] and out["apart"]
        assert out["shards"] == [UNIT // 2] * 4  # 136 elements of each unit per rank
        assert out["start"] == (0, 0)  # no persistent unit: nothing gathered before the first forward
        assert all(out["seen"]) and len(out["seen"]) == 12
        per_gather = UNIT // 2 * 4  # bytes of one shard: 544
        first = out["phases"][0]
        assert first[0] == (0, 0, 0)
        assert first[1] == (4, 4, 4 * per_gather)  # the first forward (no trace yet): each unit once
        assert first[2] == (8, 8, 8 * per_gather)  # its backward gathers each unit again
        # later steps follow the trace: backward's units are prefetched as the forward ends, and the last
        # layer's unit is kept for the backward that starts with it: 4 + 3 gathers, one shard copied up each
        for before, _, backward in out["phases"][1:]:
            assert tuple(b - a for a, b in zip(before, backward, strict=True)) == (7, 7, 7 * per_gather)
        assert out["staged"] and all(n == UNIT // 2 for n in out["staged"])  # prefetches copied ahead
        assert out["down"] == (0, 0)
        assert out["written"] == (1, per_gather)
        # the unit is weight (256) then bias (16): rank 0's shard is weight[:136], rank 1's the rest and the bias
        assert out["bias"] == ([3.0] * WIDTH if rank == 1 else [])
        assert out["check group"] == "gloo"  # the path checks' host tensors, whatever the data group's backend


def bit_identical(rank, world_size):
    torch.manual_seed(0)
    base = Stack()
    frozen = copy.deepcopy(base)
    frozen.layers[1].requires_grad_(False)
    results = {"initial": base.layers[1].weight.detach().clone()}
    for name, model, extra in (("plain", base, {}), ("offload", base, OFFLOAD),
                               ("offload both", base, {**OFFLOAD, "offload_optimizer": {"device": "cpu"}}),
                               ("frozen", frozen, {}), ("frozen offload", frozen, OFFLOAD)):
        model = copy.deepcopy(model)
        zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW,
                             config={**STAGE3, "stage3_max_reuse_distance": 0, **extra})
        losses = _train(model, zero, 4, rank)
        copies = zero._stage3.transfers.up_copies + (zero._frozen.stage3.transfers.up_copies if zero._frozen else 0)
        zero.close()
        results[name] = (losses, [p.detach().clone() for p in model.parameters()], copies)
    return results


def test_parameter_offload_trains_bit_for_bit_as_without_it_frozen_parameters_too():
    for out in spawn(bit_identical, world_size=2):
        for offloaded, plain in (("offload", "plain"), ("frozen offload", "frozen")):
            assert out[offloaded][0] == out[plain][0]
            assert all(torch.equal(a, b) for a, b in zip(out[offloaded][1], out[plain][1], strict=True))
            assert out[offloaded][2] > 0 and out[plain][2] == 0  # copied up only with the offload
        assert out["offload both"][0] == pytest.approx(out["plain"][0], rel=1e-5)  # (ds_ops' CPU Adam)
        assert torch.equal(out["frozen offload"][1][2], out["initial"])  # the frozen layer's weight never changed
        assert not torch.equal(out["offload"][1][2], out["initial"])  # (where it trains, it changes)


def inference(rank, world_size):
    torch.manual_seed(0)
    model = Stack()
    x = _batch(0, 0)
    with torch.no_grad():
        expected = model(x)
    out = {}
    for name, extra in (("plain", {}), ("offload", OFFLOAD)):
        copy_ = copy.deepcopy(model)
        zero = ZeroInference(copy_, config={**STAGE3, **extra})
        with torch.no_grad():
            got = copy_(x)
        out[name] = (torch.equal(got, expected), zero._stage3.transfers.up_copies,
                     zero._stage3.transfers.up_bytes, zero._partition.device.type,
                     all(p.numel() == 0 for p in copy_.parameters()))
        zero.close()
    return out


def test_zero_inference_with_parameter_offload_equals_the_model():
    for out in spawn(inference, world_size=2):
        assert out["plain"] == (True, 0, 0, "cpu", True)
        assert out["offload"] == (True, 4, 4 * (UNIT // 2) * 4, "cpu", True)


def test_an_offloaded_partition_of_an_accelerator_model_needs_the_optimizer_step_on_the_host():
    config = ZeroConfig.from_section_or_ds_config({**STAGE3, **OFFLOAD})
    with pytest.raises(NotImplementedError, match=re.escape("offload_param.device 'cpu' for a model on cuda:0 "
                                                            "needs offload_optimizer.device 'cpu'")):
        partition_buffer(8, torch.float32, torch.device("cuda", 0), config, stepped_on_host=False)
    host = partition_buffer(8, torch.float32, torch.device("cpu"), config, stepped_on_host=False)
    assert host.device.type == "cpu" and host.tolist() == [0.0] * 8  # a CPU model: the host is its device
    on_device = partition_buffer(8, torch.float32, torch.device("cpu"), ZeroConfig.from_section_or_ds_config(STAGE3))
    assert on_device.tolist() == [0.0] * 8


def init_on_the_accelerator(rank, world_size):
    with Init(remote_device="none"):
        model = Stack(2)
    with Init(remote_device="cpu"):
        hosted = Stack(2)
    return [(p.device.type, p.numel(), p.ds_tensor.device.type, p.ds_tensor.numel()) for p in
            [*model.parameters(), *hosted.parameters()]]


def test_init_keeps_slices_on_the_accelerator_device_which_is_the_cpu_here():
    for rows in spawn(init_on_the_accelerator, world_size=2):
        assert rows == [("cpu", 0, "cpu", shard) for shard in (128, 8, 128, 8)] * 2  # weight, bias: halves
    with pytest.raises(ValueError, match="remote_device must be None, 'none' \\(the accelerator's device\\), 'cpu' "
                                         "or 'nvme', got 'gpu'"):
        Init(remote_device="gpu", enabled=False)


# -------------------------------------------------------------------------------------- CUDA, 1 rank
def cuda_trains(rank, world_size, precision, offload):
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    base = Stack().to(device)
    initial = [p.detach().clone() for p in base.parameters()]
    reference = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    expected = []
    for step in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = reference(_batch(step, rank, device)).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    model = copy.deepcopy(base)
    extra = {**OFFLOAD, "offload_optimizer": {"device": "cpu"}} if offload else {}
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config={**STAGE3, **extra},
                         bf16={"enabled": precision == "bf16"})
    stage3 = zero._stage3
    where = (zero._flat.device.type, zero._flat.is_pinned(), stage3.device.type,
             {p.device.type for p in model.parameters()})
    losses = _train(model, zero, 5, rank, device, dtype)
    copied = stage3.transfers.up_bytes
    zero.close()
    pairs = list(zip(model.parameters(), reference.parameters(), initial, strict=True))
    error = max(float((a.float() - b).abs().max()) for a, b, _ in pairs)
    mean_error = max(float((a.float() - b).abs().mean()) for a, b, _ in pairs)
    moved = min(float((b - c).abs().mean()) for _, b, c in pairs)  # how far torch's training moved them
    return {"losses": losses, "expected": expected, "where": where, "copied": copied, "error": error,
            "mean_error": mean_error, "moved": moved}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "offload-param"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage_3_trains_a_model_on_the_gpu_as_torch_adamw(precision, offload):
    out = spawn(cuda_trains, world_size=1, args=(precision, offload), backend="nccl")[0]
    assert out["where"] == (("cpu", True) if offload else ("cuda", False)) + ("cuda", {"cuda"})
    assert (out["copied"] > 0) == offload
    tolerance = 1e-4 if precision == "fp32" else 3e-2
    assert out["losses"] == pytest.approx(out["expected"], rel=tolerance, abs=tolerance)
    assert out["moved"] > 5e-3  # (so the comparison below means something)
    if precision == "fp32":
        assert out["error"] < 1e-4
    else:  # bf16 parameters against torch's float32 ones under autocast: bf16's rounding, and Adam's sign-like
        assert out["mean_error"] < out["moved"] / 3 and out["error"] < 0.1  # steps where a gradient is near 0


def cuda_init_and_inference(rank, world_size, offload):
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        reference = Stack()
    torch.manual_seed(0)
    with Init():
        model = Stack()
    built = [(p.device.type, p.numel(), p.ds_tensor.device.type) for p in model.parameters()]
    with GatheredParameters(list(model.parameters())):
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    x = _batch(0, 0, "cuda")
    with torch.no_grad():
        expected = reference(x)
    zero = ZeroInference(model, config={**STAGE3, **(OFFLOAD if offload else {})})
    with torch.no_grad():
        got = model(x)
    out = {"built": built, "same": same, "close": float((got - expected).abs().max()),
           "partition": (zero._partition.device.type, zero._partition.is_pinned()),
           "copied": zero._stage3.transfers.up_bytes}
    zero.close()
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "offload-param"])
def test_init_builds_on_the_gpu_and_zero_inference_runs_there(offload):
    out = spawn(cuda_init_and_inference, world_size=1, args=(offload,), backend="nccl")[0]
    assert out["built"] == [("cuda", 0, "cuda")] * 8 and out["same"]
    assert out["close"] < 1e-5
    assert out["partition"] == (("cpu", True) if offload else ("cuda", False))
    assert (out["copied"] > 0) == offload
