"""The stage's device and the messages' device (issue 28): the choice through ds-ops' accelerator seam
(a stand-in accelerator on the CPU), the wire device per backend, micro-batches moved to the stage,
every buffer the executor and the channel allocate given an explicit device (read from the source),
and, on a GPU, a stage on cuda trained over NCCL equal to plain PyTorch on the GPU."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import ds_pipe
from ds_comm.testing import spawn
from ds_pipe import _device, _executor

SRC = Path(ds_pipe.__file__).parent
# the modules whose buffers meet the stage's tensors or travel to a neighbour
CHECKED = ("_executor.py", "_p2p.py", "_zero_bubble.py", "_device.py")
FACTORIES = {"zeros", "empty", "ones", "full", "tensor"}
# (file, factory) pairs that may omit device=, with the reason; none today
ALLOWED: dict[tuple[str, str], str] = {}


class FakeAccelerator:
    """Answers as ds-ops' accelerator would, for a device type the machine may not have."""

    def __init__(self, name: str, count: int = 1):
        self.name, self.count, self.current = name, count, None

    def device_name(self, index=None):
        return self.name if index is None or self.name == "cpu" else f"{self.name}:{index}"

    def device_count(self):
        return self.count

    def set_device(self, index):
        self.current = index


def _factory_calls_without_device(source: str) -> list[tuple[str, int]]:
    """``torch.<factory>(...)`` calls that pass no ``device=`` keyword: (factory, line)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch" \
                and not any(k.arg == "device" for k in node.keywords):
            out.append((node.func.attr, node.lineno))
    return out


def test_the_checker_finds_an_allocation_without_a_device():
    planted = "import torch\na = torch.zeros(3, dtype=torch.int64)\nb = torch.empty(2, device=d)\n" \
              "c = torch.tensor([1])\nd = torch.zeros_like(a)\n"
    assert _factory_calls_without_device(planted) == [("zeros", 2), ("tensor", 4)]


@pytest.mark.parametrize("name", CHECKED)
def test_every_buffer_of_the_executor_and_the_channel_names_its_device(name):
    missing = [(factory, line) for factory, line in _factory_calls_without_device((SRC / name).read_text())
               if (name, factory) not in ALLOWED]
    assert missing == [], f"{name}: torch factory calls without device= (NCCL cannot send CPU tensors): {missing}"


def test_the_stage_device_follows_the_accelerator_and_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert _device.stage_device(FakeAccelerator("cpu")) == torch.device("cpu")
    assert _device.stage_device(FakeAccelerator("cuda", count=8)) == torch.device("cuda", 3)
    assert _device.stage_device(FakeAccelerator("cuda", count=2)) == torch.device("cuda", 1)  # as init_distributed
    monkeypatch.setattr(_device.ds_ops, "get_accelerator", lambda: FakeAccelerator("cuda", count=4))
    assert _device.stage_device() == torch.device("cuda", 3)  # the seam when none is given


def test_the_module_device_is_its_parameters_else_the_stage_device(monkeypatch):
    assert _device.module_device(nn.Linear(2, 2).to("meta")) == torch.device("meta")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert _device.module_device(nn.ReLU(), FakeAccelerator("cuda")) == torch.device("cuda", 0)
    assert _device.module_device(nn.ReLU(), FakeAccelerator("cpu")) == torch.device("cpu")


def test_messages_travel_on_the_device_through_nccl_and_on_the_host_through_gloo(monkeypatch):
    cuda, cpu = torch.device("cuda", 1), torch.device("cpu")
    assert _device.wire_device(cuda, "nccl") == cuda
    assert _device.wire_device(cuda, "gloo") == cpu  # gloo sends host memory only
    assert _device.wire_device(cpu, "gloo") == cpu
    monkeypatch.setattr(_device.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert _device.backend_of(None, cuda) == "nccl" and _device.backend_of(None, cpu) == "gloo"
    monkeypatch.setattr(_device.dist, "get_backend", lambda group=None: "nccl")
    assert _device.backend_of(None, cpu) == "nccl"


def test_micro_batches_move_to_the_stage_device_and_stay_put_where_they_are():
    x, y, mask = torch.randn(2, 3), torch.arange(4), torch.ones(2, dtype=torch.bool)
    batch = ((x, {"mask": mask, "n": 7}), [y])
    same = _executor._to_device(batch, torch.device("cpu"))
    assert same[0][0] is x and same[0][1]["mask"] is mask and same[1][0] is y and same[0][1]["n"] == 7
    moved = _executor._to_device(batch, torch.device("meta"))
    assert moved[0][0].device.type == "meta" and moved[0][1]["mask"].device.type == "meta"
    assert moved[1][0].device.type == "meta" and isinstance(moved[1], list) and moved[0][1]["n"] == 7
    assert moved[0][0].shape == x.shape and moved[1][0].dtype == y.dtype


# ---------------------------------------------------------------------------------------- on a GPU
D, MICRO, BATCH, STEPS = 16, 3, 4, 3


def _layers():
    torch.manual_seed(0)
    return [nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 1)]


def _micro_batches(step: int):
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(BATCH, D, generator=g), torch.randn(BATCH, 1, generator=g)) for _ in range(MICRO)]


def one_stage_trains_like_torch(rank, world_size, device_type):
    """A 1-stage executor on ``device_type`` over the default backend, and the same layers trained by
    plain torch on that device (the loss of each micro-batch / micro-batches, one AdamW step per batch)."""
    layers = _layers()
    reference = nn.Sequential(*copy.deepcopy(layers)).to(device_type)
    module = ds_pipe.PipelineModule(layers, num_stages=1, loss_fn=nn.functional.mse_loss, partition_method="uniform")
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    executor = ds_pipe.PipelineExecutor(module, optimizer, micro_batches=MICRO)
    expected = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, reference_losses = [], []
    for step in range(STEPS):
        data = _micro_batches(step)  # on the host: the executor moves them
        losses.append(executor.train_batch(iter(data)))
        total = 0.0
        for x, y in data:
            loss = nn.functional.mse_loss(reference(x.to(device_type)), y.to(device_type))
            (loss / MICRO).backward()
            total += float(loss.detach()) / MICRO
        expected.step()
        expected.zero_grad()
        reference_losses.append(total)
    got, want = list(module.parameters()), list(reference.parameters())
    return {"devices": sorted({str(p.device) for p in got}), "executor": str(executor.device),
            "wire": str(executor.channel.wire), "loss_device": str(losses[0].device),
            "losses": [float(x) for x in losses], "reference_losses": reference_losses,
            "max_diff": max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)),
            "moved": max(float((a.detach().cpu() - b.detach()).abs().max())
                         for a, b in zip(got, nn.Sequential(*_layers()).parameters(), strict=True))}


def test_a_one_stage_executor_trains_like_torch_on_the_cpu():
    (result,) = spawn(one_stage_trains_like_torch, world_size=1, args=("cpu",), env={"DS_ACCELERATOR": "cpu"})
    assert result["devices"] == ["cpu"] and result["executor"] == "cpu" and result["wire"] == "cpu"
    assert result["max_diff"] < 1e-6 and result["moved"] > 1e-2
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_one_stage_executor_trains_on_cuda_over_nccl_like_torch_on_the_gpu():
    (result,) = spawn(one_stage_trains_like_torch, world_size=1, args=("cuda",), backend="nccl", timeout=300)
    assert result["devices"] == ["cuda:0"] and result["executor"] == "cuda:0"
    assert result["wire"] == "cuda:0" and result["loss_device"] == "cuda:0"  # NCCL: messages on the GPU
    assert result["max_diff"] < 1e-4 and result["moved"] > 1e-2
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-4)
