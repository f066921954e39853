"""ZeroOptimizer on a device (stages 0-2 and ZeRO-Offload): on the CPU, the same code paths a GPU runs
(the offload's host<->device copies counted byte for byte, every training buffer made with an explicit
``device=``, the model's one device checked); on a CUDA GPU (``cuda`` marker, world size 1 over NCCL,
run by scripts/gpu_check.sh), training equal to plain PyTorch's AdamW on the GPU and a checkpoint round
trip."""

from __future__ import annotations

import ast
import copy
import pathlib

import pytest
import torch
from torch import nn

import ds_ops
import ds_zero
from ds_comm.testing import spawn
from ds_zero import ZeroOptimizer

WIDTH = 16
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 2))


def _batch(step: int, micro: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, WIDTH, generator=g).to(device)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x.to(next(model.parameters()).dtype)).float().square().mean()


# ------------------------------------------------------------------ (a) the offload's copies, counted
def offload_counts(rank, world_size):
    out = []
    for stage, precision, bf16_master, gas in [(1, "fp32", False, 1), (2, "fp32", False, 1), (1, "bf16", False, 1),
                                                (2, "bf16", False, 2), (2, "bf16", True, 1)]:
        model = _model()
        bf16 = {"enabled": precision == "bf16", "bf16_master_weights_and_grads": bf16_master,
                "bf16_optimizer_states": False}
        zero = ZeroOptimizer(model, ds_ops.CPUAdam, optimizer_kwargs={"lr": 1e-2, "fp32_optimizer_states": True},
                             config={"stage": stage, "reduce_bucket_size": 200, "offload_optimizer": {"device": "cpu"}},
                             bf16=bf16, gradient_accumulation_steps=gas)
        host, layout = zero._host, zero.layout
        item = zero._flat.element_size()
        shard_bytes = sum(b.shard for b in layout.buckets) * item
        separate = all(h.untyped_storage().data_ptr() != d.untyped_storage().data_ptr()
                       for h, d in ((host.grads, zero._flat), (host.params, zero._flat),
                                    (host.grads, zero._grads if stage < 2 else zero._partition)))
        before = [p.detach().clone() for p in model.parameters()]
        steps = []
        for step in range(2):
            host.counts.reset()
            for micro in range(gas):
                zero.backward(_loss(model, _batch(step, micro, rank)))
                zero.step()
            c = host.counts
            steps.append((c.down_copies, c.down_bytes, c.up_copies, c.up_bytes))
        moved = max(float((p.detach().float() - b.float()).abs().max()) for p, b in zip(model.parameters(), before,
                                                                                      strict=True))
        out.append({"case": (stage, precision, bf16_master, gas), "steps": steps, "buckets": len(layout.buckets),
                    "shard_bytes": shard_bytes, "separate": separate, "moved": moved,
                    "device": str(zero.device), "master_on_host": zero._step_params[0].device.type})
        zero.close()
    return out


def test_offload_copies_exactly_the_gradient_shard_down_and_the_parameter_shard_up():
    for result in spawn(offload_counts, world_size=2, timeout=240):
        for case in result:
            bf16_master = case["case"][2]
            n, shard = case["buckets"], case["shard_bytes"]
            # bf16 master weights: the flat (bf16) buffer is the master; the host's mirror of it is read first
            down = (2 * n, 2 * shard) if bf16_master else (n, shard)
            for counted in case["steps"]:
                assert counted == (*down, n, shard), case
            assert case["separate"] and case["moved"] > 1e-3, case
            assert case["device"] == "cpu" and case["master_on_host"] == "cpu"


def offload_and_moved_states(rank, world_size):
    import ds_zero._offload_states as offload_module
    from ds_zero import OffloadStateTypeEnum

    original = offload_module._move_root  # copy every root even on the host: the re-pointing runs as on a GPU
    offload_module._move_root = lambda *a, **k: original(*a, **{**k, "force": True})
    out = []
    for stage in (1, 2):
        runs = []
        for move in (False, True):
            model = _model()
            zero = ZeroOptimizer(model, ds_ops.CPUAdam, optimizer_kwargs={"lr": 1e-2},
                                 config={"stage": stage, "reduce_bucket_size": 200,
                                         "offload_optimizer": {"device": "cpu"}}, bf16={"enabled": True})
            # hold the first buffer: freed, its address could be handed out again to the reloaded copy
            first = zero._flat.untyped_storage()
            flat = first.data_ptr()
            for step in range(3):
                zero.backward(_loss(model, _batch(step, 0, rank)))
                zero.step()
                zero.zero_grad()
                if move:
                    zero.offload_states(include=[OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.lp_grads])
                    zero.reload_states()
            moved = zero._flat.untyped_storage().data_ptr() != flat
            runs.append(([p.detach().clone() for p in model.parameters()], moved, zero._host.device_params[0]
                         .untyped_storage().data_ptr() == zero._flat.untyped_storage().data_ptr()))
            zero.close()
            del first
        (plain, _, _), (moved_run, moved, follows) = runs
        out.append((stage, all(torch.equal(a, b) for a, b in zip(plain, moved_run, strict=True)), moved, follows))
    return out


def test_offload_trains_the_same_around_offload_states():
    # offload_states moves the flat buffer: the offload's copies must follow it to its new place
    for result in spawn(offload_and_moved_states, world_size=2, timeout=240):
        assert result == [(1, True, True, True), (2, True, True, True)]


# ------------------------------------------------------------------ (b) every training buffer gets a device=
SOURCE = pathlib.Path(ds_zero.__file__).parent
# modules that do not run training: checkpoint converters and readers, the memory estimator, the config
NOT_TRAINING = {"_deepspeed_format.py", "_export.py", "_estimate.py", "_storage.py", "_nvme_checkpoint.py", "config.py"}
CREATORS = {"zeros", "empty", "ones", "full", "zeros_like", "empty_like", "ones_like", "full_like"}
# (module, function): why a tensor made there has no device= (none is a training buffer)
ALLOWED = {
    ("_checkpoint.py", "_sharded"): "an empty tensor only describes a dtype to ShardedTensor's metadata",
    ("_checkpoint_tp.py", "sharded_slice"): "the same, for a tensor-parallel slice's pieces of the whole parameter",
    ("_init.py", "put"): "DeepSpeed's empty placeholder for a shard kept on NVMe",
}


def _creations_without_device() -> list[str]:
    found = []
    for path in sorted(SOURCE.glob("*.py")):
        if path.name in NOT_TRAINING:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            if (path.name, function.name) in ALLOWED:
                continue
            for call in ast.walk(function):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) \
                        and isinstance(call.func.value, ast.Name) and call.func.value.id == "torch" \
                        and call.func.attr in CREATORS and not any(k.arg == "device" for k in call.keywords):
                    found.append(f"{path.name}:{call.lineno} in {function.name}: {ast.unparse(call)}")
    return found


def test_every_tensor_ds_zero_makes_for_training_names_its_device():
    # a buffer left on the CPU would be caught on a GPU only; this catches it here
    assert _creations_without_device() == []


def test_every_allowed_exception_names_a_function_that_exists():
    # an entry left behind by a rename would silently allow whatever a new function of that name makes
    defined = {(path.name, n.name) for path in SOURCE.glob("*.py")
               for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert sorted(set(ALLOWED) - defined) == []


def test_the_device_check_sees_a_call_without_device(tmp_path, monkeypatch):
    (tmp_path / "_probe.py").write_text("import torch\n\ndef make(n):\n    return torch.zeros(n, dtype=torch.int8)\n")
    monkeypatch.setattr(f"{__name__}.SOURCE", tmp_path)
    assert _creations_without_device() == ["_probe.py:4 in make: torch.zeros(n, dtype=torch.int8)"]


# ------------------------------------------------------------------ (c) one device for the model
def test_parameters_on_two_devices_are_refused_naming_both():
    model = _model()
    model[2].weight = nn.Parameter(torch.empty(WIDTH, WIDTH, device="meta"))
    with pytest.raises(ValueError, match=r"0\.weight is on cpu and 2\.weight on meta.*model\.to\(device\)"):
        ZeroOptimizer(model, torch.optim.AdamW, config={"stage": 1})


def cpu_device(rank, world_size):
    zero = ZeroOptimizer(_model(), torch.optim.AdamW, config={"stage": 2, "reduce_bucket_size": 200})
    buffers = [zero._flat, zero._partition, *zero._bucket_buffers, *zero._received]
    return str(zero.device), sorted({t.device.type for t in buffers})


def test_a_cpu_model_trains_on_the_cpu():
    assert spawn(cpu_device, world_size=2) == [("cpu", ["cpu"])] * 2


# ------------------------------------------------------------------ (d) on a CUDA GPU (world size 1, NCCL)
CUDA_CASES = [(stage, precision, offload) for offload in ("none", "cpu") for precision in ("fp32", "bf16")
              for stage in ((0, 1, 2) if offload == "none" else (1, 2))]  # offload partitions: stages 1-3
STEPS, LR = 5, 1e-2  # weight decay: torch AdamW's default, 0.01, given to CPUAdam too


def _reference(model: nn.Module, precision: str, device: torch.device) -> tuple[list, list]:
    """Plain PyTorch on the GPU: AdamW over float32 weights (bf16: a float32 master copy of the bf16 model,
    stepped with the bf16 gradients widened, then rounded into the model, as ZeRO's bf16 does)."""
    run = copy.deepcopy(model).to(device)
    if precision == "bf16":
        run = run.bfloat16()
    masters = [p.detach().float().clone().requires_grad_(True) for p in run.parameters()]
    optimizer = torch.optim.AdamW(masters, lr=LR)
    for step in range(STEPS):
        for p in run.parameters():
            p.grad = None
        _loss(run, _batch(step, 0, 0, device)).backward()
        for master, p in zip(masters, run.parameters(), strict=True):
            master.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for master, p in zip(masters, run.parameters(), strict=True):
                p.copy_(master)
    return [m.detach() for m in masters], [p.detach() for p in run.parameters()]


def train_on_cuda(rank, world_size):
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    out = []
    for stage, precision, offload in CUDA_CASES:
        model = _model()
        masters, weights = _reference(model, precision, device)
        model = model.to(device)
        config = {"stage": stage, "reduce_bucket_size": 200}
        if offload != "none":
            config["offload_optimizer"] = {"device": offload}
        optimizer = ds_ops.CPUAdam if offload != "none" else torch.optim.AdamW
        zero = ZeroOptimizer(model, optimizer, optimizer_kwargs={"lr": LR, "weight_decay": 0.01}, config=config,
                             bf16={"enabled": precision == "bf16"})
        for step in range(STEPS):
            zero.backward(_loss(model, _batch(step, 0, 0, device)))
            zero.step()
            zero.zero_grad()
        got = [ds_zero.safe_get_full_fp32_param(p) for p in model.parameters()]
        master_error = max(float((g - m).abs().max()) for g, m in zip(got, masters, strict=True))
        weight_error = max(float((p.detach().float() - w.float()).abs().max())
                           for p, w in zip(model.parameters(), weights, strict=True))
        moved = max(float((w.float() - p.float()).abs().max())
                    for w, p in zip(weights, _model().to(device).parameters(), strict=True))
        devices = sorted({t.device.type for t in [zero._flat, *zero._shard_grads, *got]})
        step_device = zero._step_params[0].device.type
        counts = (zero._host.counts.down_bytes, zero._host.counts.up_bytes) if zero._host is not None else None
        out.append({"case": (stage, precision, offload), "master_error": master_error, "weight_error": weight_error,
                    "moved": moved, "devices": devices, "step_device": step_device, "counts": counts,
                    "pinned": zero._host.grads.is_pinned() if zero._host is not None else None})
        zero.close()
    return out


@pytest.mark.cuda
@cuda
def test_stages_0_to_2_train_on_cuda_as_plain_pytorch_adamw():
    (result,) = spawn(train_on_cuda, world_size=1, backend="nccl", timeout=300)
    for case in result:
        _, precision, offload = case["case"]
        print(case)
        assert case["devices"] == ["cuda"], case
        assert case["step_device"] == ("cpu" if offload == "cpu" else "cuda"), case
        assert case["moved"] > 2e-2, case  # the steps changed the weights far beyond the tolerance below
        # float32: the same Adam arithmetic (CPU Adam under offload: a few float32 ulps); bf16: the float32
        # masters agree closely, the bf16 weights within one bf16 rounding of them
        assert case["master_error"] <= (1e-6 if precision == "fp32" else 1e-5), case
        assert case["weight_error"] <= (1e-6 if precision == "fp32" else 4e-3), case
        if offload == "cpu":
            assert case["pinned"] and case["counts"][0] > 0 and case["counts"][1] > 0, case


def checkpoint_on_cuda(rank, world_size, path):
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    out = {}
    for offload in ("none", "cpu"):
        config = {"stage": 2, "reduce_bucket_size": 200}
        if offload != "none":
            config["offload_optimizer"] = {"device": offload}
        optimizer = ds_ops.CPUAdam if offload != "none" else torch.optim.AdamW

        def build(seed: int, optimizer=optimizer, config=config):
            model = _model(seed).to(device)
            return model, ZeroOptimizer(model, optimizer, optimizer_kwargs={"lr": LR, "weight_decay": 0.01}, config=config,
                                        bf16={"enabled": True})

        model, zero = build(0)
        for step in range(2):
            zero.backward(_loss(model, _batch(step, 0, 0, device)))
            zero.step()
            zero.zero_grad()
        where = f"{path}/{offload}"
        ds_zero.save_zero_checkpoint(zero, where)
        zero.backward(_loss(model, _batch(2, 0, 0, device)))
        zero.step()
        expected = [p.detach().clone() for p in model.parameters()]
        zero.close()
        model, zero = build(1)  # other weights: the load must replace them
        ds_zero.load_zero_checkpoint(zero, where)
        zero.backward(_loss(model, _batch(2, 0, 0, device)))
        zero.step()
        out[offload] = (all(torch.equal(p.detach(), e) for p, e in zip(model.parameters(), expected, strict=True)),
                        sorted({p.device.type for p in model.parameters()}))
        zero.close()
    return out


@pytest.mark.cuda
@cuda
def test_a_checkpoint_saved_on_cuda_loads_and_training_goes_on_identically(tmp_path):
    (result,) = spawn(checkpoint_on_cuda, world_size=1, backend="nccl", args=(str(tmp_path),), timeout=300)
    assert result == {"none": (True, ["cuda"]), "cpu": (True, ["cuda"])}
