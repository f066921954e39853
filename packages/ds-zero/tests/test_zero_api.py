"""ZeroOptimizer's contract besides the numbers: memory per rank at the ZeRO formulas, unused
parameters, models that differ between ranks, state round trips, and bad input named."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ds_comm
from ds_comm.testing import spawn
from ds_zero import ZeroOptimizer, estimate_zero_model_states_mem_needs


def _model(width: int = 128, extra: int = 0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width + extra), nn.Tanh(),
                         nn.Linear(width + extra, 4))


def _train(zero, model, steps, rank, width=128):
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        zero.backward(model(torch.randn(8, width, generator=g)).square().mean())
        zero.step()
        zero.zero_grad()


def memory_by_stage(rank, world_size):
    out = {}
    for stage in (0, 1, 2):
        model = _model()
        zero = ZeroOptimizer(model, torch.optim.AdamW, config={"stage": stage, "reduce_bucket_size": 20_000})
        _train(zero, model, 1, rank)
        out[stage] = zero.memory_bytes()
    return out, sum(p.numel() for p in _model().parameters())


def test_model_state_memory_is_at_the_zero_formulas():
    # Psi * (4 + 4 + 8), (4 + 4 + (4 + 8)/N), (4 + (4 + 8)/N) bytes for float32 AdamW at stages 0, 1, 2 (stage 1
    # keeps the local gradients in .grad and its averaged shard apart: a second backward before the step)
    results = spawn(memory_by_stage, world_size=2)
    for by_stage, psi in results:
        n = 2
        formula = {0: (4, 4, 8), 1: (4, 4 + 4 / n, 8 / n), 2: (4, 4 / n, 8 / n)}
        for stage, (params, grads, states) in formula.items():
            got = by_stage[stage]
            estimate = estimate_zero_model_states_mem_needs(psi, stage=stage, world_size=n, precision="fp32")
            for kind, per_param in (("params", params), ("grads", grads), ("optimizer", states)):
                assert abs(got[kind] - psi * per_param) <= 0.01 * psi * per_param, (stage, kind, got, psi)
                assert abs(got[kind] - estimate[kind]) <= 0.01 * estimate[kind], (stage, kind, got, estimate)
            assert got["master"] == 0
        totals = [sum(by_stage[s][k] for k in ("params", "grads", "optimizer")) / psi for s in (0, 1, 2)]
        assert [round(t) for t in totals] == [16, 14, 10]
        # stage 1 reduces through bucket buffers as stage 2 does (its partition is apart from .grad)
        assert by_stage[0]["buffers"] == 0 < by_stage[1]["buffers"] == by_stage[2]["buffers"]


def different_models(rank, world_size):
    try:
        ZeroOptimizer(_model(extra=rank), torch.optim.AdamW)  # rank 1's middle layer is wider
    except ValueError as e:
        return str(e)
    return None


def test_ranks_with_different_models_get_a_clear_error_not_a_hang():
    messages = spawn(different_models, world_size=2, timeout=60)
    for message in messages:
        assert message is not None and "the ranks' models differ: parameter 2 is ('2.weight', (128, 128)," in message
        assert "on rank 1" in message


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.used(x).square().mean()


def unused_parameters(rank, world_size, stage, ignore):
    model = WithUnused()
    before = model.unused.weight.detach().clone()
    zero = ZeroOptimizer(model, torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                         config={"stage": stage, "ignore_unused_parameters": ignore, "reduce_bucket_size": 100})
    try:
        _train(zero, model, 2, rank, width=16)
    except RuntimeError as e:
        return str(e)
    return bool(torch.equal(model.unused.weight, before)), bool(torch.equal(model.used.weight, WithUnused().used.weight))


@pytest.mark.parametrize("stage", [0, 2])
def test_unused_parameters_are_zero_or_named(stage):
    for unchanged, used_unchanged in spawn(unused_parameters, world_size=2, args=(stage, True)):
        assert unchanged and not used_unchanged
    for message in spawn(unused_parameters, world_size=2, args=(stage, False)):
        assert "no gradient in this backward for unused.weight, unused.bias" in message
        assert "ignore_unused_parameters is false" in message


def state_round_trip(rank, world_size, stage):
    config = {"stage": stage, "reduce_bucket_size": 20_000, "stage3_param_persistence_threshold": 0}
    straight = _model()
    zero = ZeroOptimizer(straight, torch.optim.AdamW, config=config)
    _train(zero, straight, 5, rank)
    resumed = _model()
    first = ZeroOptimizer(resumed, torch.optim.AdamW, config=config)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        first.backward(resumed(torch.randn(8, 128, generator=g)).square().mean())
        first.step()
        first.zero_grad()
    state = copy.deepcopy(first.state_dict())
    weights = copy.deepcopy(resumed.state_dict())
    again = _model()
    if stage < 3:
        again.load_state_dict(weights)
    else:  # the weights are this rank's shards in the state: start from other values
        with torch.no_grad():
            for p in again.parameters():
                p.add_(1.0)
    second = ZeroOptimizer(again, torch.optim.AdamW, config=config)
    second.load_state_dict(state)
    for step in range(3, 5):
        g = torch.Generator().manual_seed(100 * step + rank)
        second.backward(again(torch.randn(8, 128, generator=g)).square().mean())
        second.step()
        second.zero_grad()
    if stage == 3:
        zero.close()  # whole again
        second.close()
    same = all(torch.equal(a, b) for a, b in zip(straight.parameters(), again.parameters(), strict=True))
    wrong = dict(state, zero_stage=(stage + 1) % 3)
    try:
        second.load_state_dict(wrong)
    except ValueError as e:
        return same, str(e)
    return same, None


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_dict_round_trip_resumes_exactly(stage):
    for same, message in spawn(state_round_trip, world_size=2, args=(stage,)):
        assert same
        assert message == (f"ZeroOptimizer.load_state_dict: saved with zero_stage={(stage + 1) % 3}, "
                           f"this optimizer has zero_stage={stage}")


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"config": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}}, NotImplementedError,
     "offload_param.device 'nvme' needs offload_optimizer.device 'nvme' too"),
    ({"config": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, NotImplementedError,
     "offload_optimizer.ratio 0.5 (partial offload) is not implemented"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, NotImplementedError,
     "fp16.fp16_master_weights_and_grads is not implemented"),
    ({"bf16": {"enabled": True}, "communication_data_type": "int8"}, ValueError,
     'communication_data_type must be "fp32", "fp16" or "bf16" (or null), got \'int8\''),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, ValueError, "both true"),
    ({"config": {"mics_hierarchical_params_gather": True}}, NotImplementedError, "mics_hierarchical_params_gather (MiCS)"),
    ({"config": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 0.1}}},
     NotImplementedError, "zero_optimization.zenflow at stage 3 is not implemented"),
    ({"config": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}}, NotImplementedError,
     "offload_optimizer.super_offload (DeepSpeed's SuperOffload for Superchips) is not implemented"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, ValueError,
     "bf16.bf16_master_weights_and_grads needs zero_optimization.stage 1, 2 or 3 (as in DeepSpeed), got 0"),
    ({"config": {"stage": 1}, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, ValueError,
     "bf16.bf16_master_weights_and_grads with bf16.bf16_optimizer_states false keeps the optimizer states in "
     "float32, which DeepSpeed allows only with ZeRO-Offload"),
    ({"config": {"reduce_bucket_size": "auto"}}, ValueError, 'reduce_bucket_size is "auto"'),
    ({"config": {"stage": 5}}, ValueError, "zero_optimization.stage must be 0, 1, 2 or 3, got 5"),
    ({"gradient_clipping": -1.0}, ValueError, "gradient_clipping must be a number >= 0"),
    ({"gradient_clipping": float("nan")}, ValueError, "gradient_clipping must be a number >= 0"),
    ({"gradient_accumulation_steps": 0}, ValueError, "gradient_accumulation_steps must be an integer >= 1, got 0"),
    ({"gradient_accumulation_steps": 2.0}, ValueError, "gradient_accumulation_steps must be an integer >= 1"),
    ({"reduce_in_backward": False, "gradient_accumulation_steps": 4}, ValueError,
     "reduce_in_backward=False means the caller accumulates the micro-steps and calls reduce_gradients() once per "
     "step; gradient_accumulation_steps must be 1, got 4"),
    ({"reduce_in_backward": False, "config": {"stage": 3}}, ValueError, "reduce_in_backward=False is for stages 0-2"),
    ({"checkpoint_names": {"nope.weight": "x"}}, ValueError, "not parameters of the model: .'nope.weight'"),
    ({"checkpoint_names": {"0.weight": "2.weight"}}, ValueError,
     "checkpoint_names gives names another parameter has: .'2.weight'"),
    ({}, RuntimeError, "the process group is not initialised"),
])
def test_bad_input_is_named_before_any_collective(kwargs, error, message):
    assert not ds_comm.is_initialized()
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        ZeroOptimizer(_model(), torch.optim.AdamW, **kwargs)


def test_not_a_model_or_not_an_optimizer():
    with pytest.raises(ValueError, match=r"model must be a torch\.nn\.Module, got str"):
        ZeroOptimizer("model")
    with pytest.raises(ValueError, match="optimizer must be an optimizer class or a callable, got 3"):
        ZeroOptimizer(_model(), 3)


def close_detaches(rank, world_size, stage):
    model = _model()
    zero = ZeroOptimizer(model, torch.optim.AdamW, config={"stage": stage}, fp16={"enabled": True, "auto_cast": True,
                                                                          "initial_scale_power": 4})
    _train(zero, model, 2, rank)
    held = zero.memory_bytes()
    before = [p.detach().clone() for p in model.parameters()]
    zero.close()
    zero.close()  # twice is harmless
    after = zero.memory_bytes()
    # no hook of ds-zero's runs now: a backward gives plain gradients and issues no collective (rank 1
    # does two backwards, rank 0 none: a hook that reduced would hang or fail here)
    grads_plain = True
    for _ in range(2 * rank):
        model.zero_grad()
        model(torch.randn(8, 128).half()).float().square().mean().backward()
        grads_plain &= all(p.grad is not None and p.grad.data_ptr() != 0 for p in model.parameters())
    try:
        zero.step()
        stepped = "no error"
    except RuntimeError as e:
        stepped = str(e)
    kept = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    ds_comm.barrier()
    return held, after, grads_plain, stepped, kept


@pytest.mark.parametrize("stage", [0, 2])
def test_close_removes_the_hooks_and_frees_the_training_state(stage):
    for held, after, grads_plain, stepped, kept in spawn(close_detaches, world_size=2, args=(stage,)):
        assert held["grads"] > 0 and held["master"] > 0 and held["optimizer"] > 0
        assert after["grads"] == after["master"] == after["optimizer"] == after["buffers"] == 0
        assert after["params"] == held["params"]  # the model keeps its weights
        assert grads_plain and kept
        assert stepped == "ZeroOptimizer.step: this optimizer was closed"
