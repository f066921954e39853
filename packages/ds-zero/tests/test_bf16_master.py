"""bf16.bf16_master_weights_and_grads (and bf16.bf16_optimizer_states): no float32 master copy, on 2 ranks.

The reference is written out with torch in each rank, independently of ds-zero: the bf16 model in a
plain loop computes both ranks' bf16 gradients, averages them as ds-zero's reduction delivers them
(the default communication_data_type of bf16 is float32: each rank's bf16 gradient times 1/2 in
float32, summed in float32 by the reduce-scatter, rounded to bf16 once into the gradient partition),
and then either torch.optim.AdamW steps the bf16 parameters directly (states in bf16, as torch keeps
them for bf16 parameters), or, for ZeRO-Offload with float32 states, torch.optim.AdamW steps a float32
copy of each bf16 parameter whose result is rounded back to bf16 after each step: ds-ops' CPU Adam
reads the bf16 parameter, updates it in float32 with float32 moments and stores it rounded.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_comm
import ds_ops
from ds_comm.testing import spawn
from ds_zero import OneBitAdam, ZeroOptimizer, load_zero_checkpoint, save_zero_checkpoint

IN, HIDDEN, OUT, BATCH = 12, 24, 6, 8
STEPS = 6
ADAMW = {"lr": 1e-2, "weight_decay": 0.01}
BUCKET = 200  # elements: buckets (stages 1-2) end inside parameters, so shards split them


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.norm, self.fc2 = nn.Linear(IN, HIDDEN), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)
    return (model(x.to(torch.bfloat16)).float() - y).square().mean()


def _bf16(states: bool = True) -> dict:
    return {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": states}


def reference(steps: int, optimizer=torch.optim.AdamW, kwargs=None, float32_states: bool = False,
              clip: float = 0.0) -> dict[str, torch.Tensor]:
    """The bf16 parameters after ``steps`` steps of the reference described in the module docstring."""
    model = Tiny().to(torch.bfloat16)
    names, params = zip(*model.named_parameters(), strict=True)
    copies = [p.detach().float().requires_grad_(True) for p in params] if float32_states else None
    stepped = optimizer(copies if float32_states else list(params), **(ADAMW if kwargs is None else kwargs))
    for step in range(steps):
        grads = []
        for rank in range(2):
            model.zero_grad(set_to_none=True)
            _loss(model, step, rank).backward()
            grads.append([p.grad for p in params])
        averaged = [(a.float() * 0.5 + b.float() * 0.5).to(torch.bfloat16) for a, b in zip(*grads, strict=True)]
        if clip:  # torch.nn.utils.clip_grad_norm_'s arithmetic: float32 norms of the bf16 gradients
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32)
                                                         for g in averaged]))
            coefficient = (clip / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(averaged, coefficient)
        if float32_states:
            for copy, p, g in zip(copies, params, averaged, strict=True):
                copy.data.copy_(p.detach())
                copy.grad = g.float()
            stepped.step()
            with torch.no_grad():
                for copy, p in zip(copies, params, strict=True):
                    p.copy_(copy)  # rounded to bf16, as the CPU Adam stores it
        else:
            for p, g in zip(params, averaged, strict=True):
                p.grad = g
            stepped.step()
    return {name: p.detach().clone() for name, p in zip(names, params, strict=True)}


def _zero(model: nn.Module, stage: int, optimizer=torch.optim.AdamW, kwargs=None, offload: bool = False,
          states: bool = True, clip: float = 0.0) -> ZeroOptimizer:
    config = {"stage": stage, "reduce_bucket_size": BUCKET}
    if offload:
        config["offload_optimizer"] = {"device": "cpu"}
    return ZeroOptimizer(model, optimizer, optimizer_kwargs=ADAMW if kwargs is None else kwargs, config=config,
                         bf16=_bf16(states), gradient_clipping=clip)


def _train(zero: ZeroOptimizer, model: nn.Module, rank: int, steps: range) -> None:
    for step in steps:
        zero.backward(_loss(model, step, rank))
        assert zero.step()
        zero.zero_grad()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of two bf16 tensors in bf16 ulps of the tensor's largest magnitude (0:
    bitwise equal): a parameter that started at zero (a bias) differs by many of its own ulps when an
    update of the tensor's size moves by one rounding."""
    a, b = a.float(), b.float()
    scale = torch.maximum(a.abs().max(), b.abs().max()).clamp(min=2.0 ** -100)
    ulp = 2.0 ** (torch.floor(torch.log2(scale)) - 7)
    return float(((a - b).abs() / ulp).max())


def _compare(zero: ZeroOptimizer, expected: dict[str, torch.Tensor]) -> dict:
    got = zero.full_state_dict(rank0_only=False)
    dtypes = {t.dtype for state in zero.optimizer.state.values() for k, t in state.items() if k != "step"}
    return {"equal": all(torch.equal(got[n], t) for n, t in expected.items()),
            "ulps": max(_ulps(got[n], t) for n, t in expected.items()),
            "differing": sum(int((got[n] != t).sum()) for n, t in expected.items()),
            "numel": sum(t.numel() for t in expected.values()),
            "moved": max(float((got[n].float() - t.float()).abs().max()) for n, t in reference(0).items()),
            "param_dtypes": sorted({str(t.dtype) for t in got.values()}),
            "state_dtypes": sorted(str(d) for d in dtypes), "no_master": zero._master is None,
            "memory": zero.memory_bytes(), "stepped": sum(t.numel() for t in zero._step_params)}


# ------------------------------------------------------------------------------------- (a) bf16 states
def bf16_states_follow_torch(rank, world_size, stage):
    expected = reference(STEPS)
    model = Tiny()
    zero = _zero(model, stage)
    _train(zero, model, rank, range(STEPS))
    return _compare(zero, expected)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_master_and_states_equal_torch_adamw_on_the_bf16_parameters(stage):
    # torch's AdamW steps ZeRO's bf16 views exactly as it steps the reference's bf16 parameters (an
    # elementwise update, the same gradients bit for bit): the parameters are equal bitwise
    for out in spawn(bf16_states_follow_torch, world_size=2, args=(stage,)):
        print(f"stage {stage}: {out['differing']} of {out['numel']} parameters differ ({out['ulps']:g} bf16 ulps); "
              f"moved up to {out['moved']:.3g} from the start")
        assert out["equal"], out
        assert out["moved"] > 1e-2  # the steps did change the parameters
        assert out["param_dtypes"] == ["torch.bfloat16"] and out["state_dtypes"] == ["torch.bfloat16"]
        # (c) no float32 master copy: bf16 parameters, bf16 gradients, 2 bf16 Adam moments
        assert out["no_master"] and out["memory"]["master"] == 0
        assert out["memory"]["optimizer"] == 2 * 2 * out["stepped"]


def clipped(rank, world_size, stage):
    expected, unclipped = reference(STEPS, clip=0.05), reference(STEPS)
    model = Tiny()
    zero = _zero(model, stage, clip=0.05)
    _train(zero, model, rank, range(STEPS))
    return _compare(zero, expected), _compare(zero, unclipped)["differing"], zero.get_global_grad_norm()


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_clipping_scales_the_bf16_gradients(stage):
    # ZeRO sums each parameter's squares over its pieces and the ranks, the reference takes torch's
    # per-parameter norms: the clipping coefficient may differ in its last float32 bit, which can move
    # a clipped bf16 gradient by one rounding; so the parameters must agree within 1 bf16 ulp (of each
    # tensor's largest value) with at most 2% of them differing (measured here: bitwise equal)
    for out, unclipped, norm in spawn(clipped, world_size=2, args=(stage,)):
        print(f"stage {stage}: {out['differing']} of {out['numel']} differ from the clipped reference, up to "
              f"{out['ulps']:g} bf16 ulps ({unclipped} from the unclipped one); last norm {norm:.3g}")
        assert norm > 0.05 and unclipped > out["numel"] // 2  # clipping was active and changed the run
        assert out["ulps"] <= 1.0 and out["differing"] <= out["numel"] // 50, out
        assert out["moved"] > 1e-2 and out["state_dtypes"] == ["torch.bfloat16"]


# --------------------------------------------------------------------- (b) ZeRO-Offload, float32 states
def offloaded(rank, world_size, stage, float32_states):
    kwargs = {**ADAMW, "fp32_optimizer_states": float32_states}
    expected = reference(STEPS, float32_states=True)
    model = Tiny()
    zero = _zero(model, stage, ds_ops.CPUAdam, kwargs, offload=True, states=not float32_states)
    _train(zero, model, rank, range(STEPS))
    out = _compare(zero, expected)
    bf16_master = out["memory"]
    plain = ZeroOptimizer(Tiny(), ds_ops.CPUAdam, optimizer_kwargs=ADAMW, bf16={"enabled": True},
                          config={"stage": stage, "reduce_bucket_size": BUCKET, "offload_optimizer": {"device": "cpu"}})
    _train(plain, plain.model, rank, range(1))
    return out, bf16_master, plain.memory_bytes()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_with_float32_states_follows_float32_adam_on_bf16_parameters(stage):
    # ds-ops' CPU Adam and torch's AdamW compute the same float32 formulas with their own rounding
    # (a few float32 ulps at most, depending on the CPU's vector instructions); stored in bf16, such a
    # difference crosses a bf16 rounding boundary only rarely, and then moves that parameter by 1 bf16
    # ulp (which later steps may carry a little further): at most 2 bf16 ulps (of each tensor's largest
    # value) and at most 2% of the parameters differ (measured here: none)
    for out, memory, plain in spawn(offloaded, world_size=2, args=(stage, True)):
        print(f"stage {stage}: {out['differing']} of {out['numel']} parameters differ, up to {out['ulps']:g} bf16 "
              f"ulps; moved up to {out['moved']:.3g}")
        assert out["ulps"] <= 2.0 and out["differing"] <= out["numel"] // 50, out
        assert out["moved"] > 1e-2 and out["state_dtypes"] == ["torch.float32"]
        # (c) no float32 master copy; the float32-master run of the same model holds one of 4 bytes a parameter
        assert out["no_master"] and memory["master"] == 0 and plain["master"] == 4 * out["stepped"]
        assert memory["optimizer"] == plain["optimizer"] == 2 * 4 * out["stepped"]


def test_offload_with_bf16_states_keeps_them_in_bf16():
    # fp32_optimizer_states=False (DeepSpeed's requirement with bf16_optimizer_states under offload):
    # bf16 moments, stochastically rounded by the CPU Adam, so the run stays near the float32-states
    # reference without following it bitwise: within 4 bf16 ulps of each tensor's largest value over
    # 6 steps (measured: 118 of 510 differ, by up to 1.5)
    for out, memory, _ in spawn(offloaded, world_size=2, args=(2, False)):
        print(f"bf16 states: {out['differing']} of {out['numel']} differ from float32 states, up to "
              f"{out['ulps']:g} bf16 ulps")
        assert out["state_dtypes"] == ["torch.bfloat16"] and memory["optimizer"] == 2 * 2 * out["stepped"]
        assert out["ulps"] <= 4.0 and out["moved"] > 1e-2


# --------------------------------------------------------------------------------------- checkpoints
def checkpoint_round_trip(rank, world_size, path, saved_stage, loaded_stage, offload):
    optimizer, kwargs = (ds_ops.CPUAdam, ADAMW) if offload else (torch.optim.AdamW, None)
    model = Tiny()
    zero = _zero(model, saved_stage, optimizer, kwargs, offload=offload, states=not offload)
    _train(zero, model, rank, range(3))
    save_zero_checkpoint(zero, path)
    _train(zero, model, rank, range(3, 5))
    finished = zero.full_state_dict(rank0_only=False)
    other = Tiny()
    again = _zero(other, loaded_stage, optimizer, kwargs, offload=offload, states=not offload)
    meta = load_zero_checkpoint(again, path)
    dtypes = sorted({str(t.dtype) for s in again.optimizer.state.values() for k, t in s.items() if k != "step"})
    _train(again, other, rank, range(3, 5))
    resumed = again.full_state_dict(rank0_only=False)
    return {"resumed_equal": all(torch.equal(resumed[n], t) for n, t in finished.items()),
            "dtypes": dtypes, "precision": meta["precision"]}


@pytest.mark.parametrize(("saved", "loaded", "offload"), [(2, 3, False), (3, 1, False), (2, 2, True)])
def test_a_checkpoint_saves_the_bf16_parameters_as_master_and_resumes_bitwise(tmp_path, saved, loaded, offload):
    # the master weights saved are the bf16 parameters themselves; loading on another stage and training
    # on gives what the saving run gave (float32 states under offload are loaded in float32, not rounded)
    for out in spawn(checkpoint_round_trip, world_size=2, args=(str(tmp_path), saved, loaded, offload)):
        assert out["resumed_equal"], out
        assert out["dtypes"] == (["torch.float32"] if offload else ["torch.bfloat16"]) and out["precision"] == "bf16"
    from ds_zero import get_fp32_state_dict_from_zero_checkpoint

    exported = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert all(t.dtype == torch.float32 for t in exported.values())
    # the float32 export is the bf16 parameters widened: each value is a bf16 number
    assert all(torch.equal(t, t.to(torch.bfloat16).float()) for t in exported.values())


# ---------------------------------------------------------------------------------- (d) bad combinations
def bad_optimizer(rank, world_size, case):
    offload, states, optimizer, kwargs = case
    try:
        _zero(Tiny(), 2, optimizer, kwargs, offload=offload, states=states)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(("case", "words"), [
    ((True, False, torch.optim.AdamW, None),
     "bf16.bf16_master_weights_and_grads with zero_optimization.offload_optimizer needs ds_ops.CPUAdam "
     "(DeepSpeed: DeepSpeedCPUAdam) to step the bf16 partition, got AdamW"),
    ((True, True, ds_ops.CPUAdam, ADAMW),
     "bf16.bf16_optimizer_states keeps the optimizer states in bf16, but CPUAdam keeps them in float32 (param group "
     "0): build it with fp32_optimizer_states=False (DeepSpeed requires this of DeepSpeedCPUAdam under ZeRO-Offload)"),
    ((False, True, ds_ops.FusedAdam, ADAMW),
     "bf16.bf16_optimizer_states keeps the optimizer states in bf16, but FusedAdam keeps them in float32 (param "
     "group 0): build it with state_dtype=torch.bfloat16"),
    ((False, True, OneBitAdam, {"lr": 1e-3}), "zero_optimization.stage is 2: OneBitAdam compresses"),
])
def test_an_optimizer_that_does_not_fit_is_refused_by_name(case, words):
    for message in spawn(bad_optimizer, world_size=2, args=(case,)):
        assert message is not None and words in message, message


def test_config_combinations_are_refused_before_any_collective():
    assert not ds_comm.is_initialized()
    key = "bf16.bf16_master_weights_and_grads"
    cases = [
        ({"config": {"stage": 0}, "bf16": _bf16()}, ValueError,
         f"{key} needs zero_optimization.stage 1, 2 or 3 (as in DeepSpeed), got 0"),
        ({"config": {"stage": 2}, "bf16": _bf16(False)}, ValueError,
         f"{key} with bf16.bf16_optimizer_states false keeps the optimizer states in float32, which DeepSpeed "
         "allows only with ZeRO-Offload and its CPU Adam: set bf16.bf16_optimizer_states true, or "
         "zero_optimization.offload_optimizer.device 'cpu'"),
        ({"config": {"stage": 2}, "bf16": {**_bf16(), "enabled": False}}, ValueError,
         f"{key} needs bf16.enabled true"),
        ({"config": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, "bf16": _bf16()},
         NotImplementedError, f"{key} with zero_optimization.offload_optimizer.device 'nvme' is not implemented"),
    ]
    for kwargs, error, words in cases:
        with pytest.raises(error) as raised:
            ZeroOptimizer(Tiny(), torch.optim.AdamW, **kwargs)
        assert words in str(raised.value), (kwargs, str(raised.value))
