"""CPUAdam.step_subgroup / rollback_subgroup (DeepSpeed 0.19's ZeRO-3 subgroup API, SuperOffload's):
against CPUAdam.step() on the same partition, and the rollback against the values before the step."""

from __future__ import annotations

import logging

import pytest
import torch

import ds_ops

SIZES = [1, 7, 100003]  # a scalar, a vector tail only, and many vectors plus a tail


def _tensor(n: int, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _partition(n: int, dtype=torch.float32, seed: int = 0) -> torch.nn.Parameter:
    return torch.nn.Parameter(_tensor(n, seed, dtype))


CASES = {  # param dtype, CPUAdam keyword arguments
    "float32": (torch.float32, {}),
    "float32, bfloat16 states": (torch.float32, {"state_dtype": torch.bfloat16}),
    "bfloat16": (torch.bfloat16, {}),
    "bfloat16, bfloat16 states": (torch.bfloat16, {"fp32_optimizer_states": False}),
}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("adamw", [True, False])
def test_step_subgroup_is_bit_for_bit_step(n, case, adamw):
    dtype, kwargs = CASES[case]
    ours, ref = _partition(n, dtype), _partition(n, dtype)
    opt = ds_ops.CPUAdam([ours], lr=1e-2, weight_decay=0.1, adamw_mode=adamw, **kwargs)
    ref_opt = ds_ops.CPUAdam([ref], lr=1e-2, weight_decay=0.1, adamw_mode=adamw, **kwargs)
    for step in range(5):
        g = _tensor(n, 10 + step, dtype)
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step_subgroup(7)
        ref_opt.step()
    assert torch.equal(ours.detach(), ref.detach())
    assert set(opt.state) == {7} and opt.state[ours] == {}  # the state is the subgroup's, not the tensor's
    state = opt.state[7]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 5.0
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(state[key], ref_opt.state[ref][key])
    assert ours.detach().ne(_tensor(n, 0, dtype)).any()  # it did move


def test_subgroups_take_turns_in_one_group_as_superoffload_hands_them_in():
    """SuperOffload's worker puts each subgroup's partition into the param group in turn (the
    other groups hold parameters without gradients), with the lr of the moment."""
    sizes = {0: 1000, 1: 37, 2: 4099}
    parts = {i: _partition(n, seed=i) for i, n in sizes.items()}
    refs = {i: _partition(n, seed=i) for i, n in sizes.items()}
    dummy = torch.nn.Parameter(torch.randn(1))
    opt = ds_ops.CPUAdam([dummy], lr=1e-3)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(1))], "lr": 5e-3, "betas": (0.8, 0.99)})
    ref_opts = {i: ds_ops.CPUAdam([refs[i]], lr=5e-3 if i else 1e-3, betas=(0.8, 0.99) if i else (0.9, 0.999))
                for i in sizes}
    for step in range(3):
        for i in sizes:
            group = 1 if i else 0
            g = _tensor(sizes[i], 100 * step + i)
            parts[i].grad, refs[i].grad = g.clone(), g.clone()
            opt.param_groups[group]["params"] = [parts[i]]
            opt.step_subgroup(i)
            opt.param_groups[group]["params"] = []
            ref_opts[i].step()
    for i in sizes:
        assert torch.equal(parts[i].detach(), refs[i].detach())
        assert torch.equal(opt.state[i]["exp_avg_sq"], ref_opts[i].state[refs[i]]["exp_avg_sq"])
        assert float(opt.state[i]["step"]) == 3.0


def _snapshot(opt, p, subgroup_id):
    state = opt.state[subgroup_id]
    return p.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone(), float(state["step"])


# The rollback recomputes the step's update from m', v' and inverts each operation in float32, as
# DeepSpeed's does. Each restored value is within 8 half-ulps (2**-21) of the magnitude of what the
# step combined into it: |p| + |update| for p, |m| + (1-b1)|g| for m, v + (1-b2)g^2 for v (measured:
# <= 3 half-ulps; with L2 decay |g| + wd*|p| is the gradient's magnitude). A cancellation can leave a small value with a
# large relative error, so the bound is relative to those magnitudes, not to the value alone.
ULPS = 8 * 2.0**-24


def _assert_restored(before, after, p_stepped, g, betas, weight_decay, adamw):
    p0, m0, v0, step0 = before
    p1, m1, v1, step1 = after
    assert step1 == step0
    g_size = g.abs() if adamw else g.abs() + weight_decay * p0.abs()  # L2: the step's g was g + wd*p
    bounds = (ULPS * (p0.abs() + (p_stepped - p0).abs()) + 1e-30,
              ULPS * (m0.abs() + (1 - betas[0]) * g_size) + 1e-30,
              ULPS * (v0 + (1 - betas[1]) * g_size * g_size) + 1e-30)
    for what, b, a, bound in zip(("p", "exp_avg", "exp_avg_sq"), (p0, m0, v0), (p1, m1, v1), bounds, strict=True):
        excess = ((a - b).abs() - bound).max()
        assert excess <= 0, f"{what}: off by more than 8 half-ulps of its magnitude"


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("earlier_steps", [1, 6])
def test_rollback_restores_the_values_before_the_step(adamw, weight_decay, bias_correction, earlier_steps):
    n, betas = 100003, (0.9, 0.999)
    p = _partition(n)
    opt = ds_ops.CPUAdam([p], lr=1e-2, betas=betas, weight_decay=weight_decay, adamw_mode=adamw,
                         bias_correction=bias_correction)
    for step in range(earlier_steps):
        p.grad = _tensor(n, 10 + step)
        opt.step_subgroup(0)
    before = _snapshot(opt, p, 0)
    g = _tensor(n, 99, scale=3.0)
    p.grad = g.clone()
    opt.step_subgroup(0)
    stepped = p.detach().clone()
    assert not torch.equal(stepped, before[0])
    opt.rollback_subgroup(0)
    _assert_restored(before, _snapshot(opt, p, 0), stepped, g, betas, weight_decay, adamw)
    # and stepping again with the same gradient lands where the first try did
    opt.step_subgroup(0)
    torch.testing.assert_close(p.detach(), stepped, rtol=1e-6, atol=1e-7)


def test_rollback_to_step_zero_restores_the_zero_states_exactly():
    p = _partition(1003)
    start = p.detach().clone()
    opt = ds_ops.CPUAdam([p], lr=1e-2, weight_decay=0.1)
    p.grad = _tensor(1003, 5)
    opt.step_subgroup(3)
    opt.rollback_subgroup(3)
    state = opt.state[3]
    assert float(state["step"]) == 0.0
    assert torch.equal(state["exp_avg"], torch.zeros(1003)) and torch.equal(state["exp_avg_sq"], torch.zeros(1003))
    torch.testing.assert_close(p.detach(), start, rtol=ULPS, atol=ULPS * 1e-2)
    with pytest.raises(RuntimeError, match=r"rollback_subgroup\(3\): the subgroup's step count is 0"):
        opt.rollback_subgroup(3)


def test_rollback_then_clipped_step_matches_the_clipped_step_alone():
    """SuperOffload's clipping path: step with the raw gradient, roll back, step with the clipped one."""
    n = 4099
    p, ref = _partition(n), _partition(n)
    opt, ref_opt = ds_ops.CPUAdam([p], lr=1e-2), ds_ops.CPUAdam([ref], lr=1e-2)
    for step in range(4):
        g = _tensor(n, step, scale=5.0)
        p.grad = g.clone()
        opt.step_subgroup(0)
        opt.rollback_subgroup(0)
        p.grad = g * 0.2
        opt.step_subgroup(0)
        ref.grad = g * 0.2
        ref_opt.step()
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[0]["exp_avg_sq"], ref_opt.state[ref]["exp_avg_sq"], rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_step_with_non_finite_gradients_writes_nothing_and_rolls_back_exactly(bad, caplog):
    p = _partition(1003)
    opt = ds_ops.CPUAdam([p], lr=1e-2)
    p.grad = _tensor(1003, 1)
    opt.step_subgroup(0)
    before = _snapshot(opt, p, 0)
    p.grad = _tensor(1003, 2)
    p.grad[500] = bad
    with caplog.at_level(logging.WARNING, logger="ds_ops"):
        opt.step_subgroup(0)
    assert "the gradients hold inf or nan" in caplog.text
    after = _snapshot(opt, p, 0)
    assert after[3] == 2.0  # counted, as DeepSpeed counts it
    for b, a in zip(before[:3], after[:3], strict=True):
        assert torch.equal(a, b)
    opt.rollback_subgroup(0)
    after = _snapshot(opt, p, 0)
    assert after[3] == 1.0 and all(torch.equal(a, b) for a, b in zip(before[:3], after[:3], strict=True))


def test_closure_loss_is_returned():
    p = _partition(8)
    p.grad = torch.ones(8)
    opt = ds_ops.CPUAdam([p])
    assert opt.step_subgroup(0, closure=lambda: 1.5) == 1.5
    assert opt.rollback_subgroup(0, lambda: 2.5) == 2.5


def test_bad_calls_say_what_is_wrong():
    a, b = _partition(8), _partition(8, seed=1)
    opt = ds_ops.CPUAdam([a, b])
    with pytest.raises(RuntimeError, match=r"rollback_subgroup\(0\): the subgroup has no state"):
        opt.rollback_subgroup(0)
    with pytest.raises(ValueError, match=r"exactly one parameter must have a gradient .* found 0"):
        opt.step_subgroup(0)
    a.grad, b.grad = torch.ones(8), torch.ones(8)
    with pytest.raises(ValueError, match=r"exactly one parameter must have a gradient .* found 2"):
        opt.step_subgroup(0)
    assert dict(opt.state) == {}
    b.grad = None
    with pytest.raises(ValueError, match="subgroup_id must be an integer"):
        opt.step_subgroup(True)
    opt.step_subgroup(0)
    a.grad = None
    c = _partition(16)
    c.grad = torch.ones(16)
    opt.param_groups[0]["params"].append(c)
    with pytest.raises(ValueError, match="the subgroup's exp_avg has 8 elements, the parameter 16"):
        opt.step_subgroup(0)
    with pytest.raises(ValueError, match="the subgroup's exp_avg has 8 elements, the parameter 16"):
        opt.rollback_subgroup(0)
    assert float(opt.state[0]["step"]) == 1.0

    half = _partition(8, torch.bfloat16)
    half.grad = torch.ones(8, dtype=torch.bfloat16)
    opt = ds_ops.CPUAdam([half])
    opt.step_subgroup(0)
    with pytest.raises(ValueError, match=r"the parameter is torch\.bfloat16; a rollback inverts float32"):
        opt.rollback_subgroup(0)
    p = _partition(8)
    p.grad = torch.ones(8)
    opt = ds_ops.CPUAdam([p], state_dtype=torch.bfloat16)
    opt.step_subgroup(0)
    with pytest.raises(ValueError, match=r"exp_avg is torch\.bfloat16"):
        opt.rollback_subgroup(0)
    assert float(opt.state[0]["step"]) == 1.0
