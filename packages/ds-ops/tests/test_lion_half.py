"""CPULion on float16/bfloat16 parameters (DeepSpeed's DeepSpeedCPULion takes them): float32 math
inside, each step's result rounded to nearest even into the parameter's dtype."""

from __future__ import annotations

import pytest
import torch

import ds_ops

SIZES = [1, 7, 100003]  # a scalar, a vector tail only, and many vectors plus a tail
HALF = [torch.float16, torch.bfloat16]


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _lion_rounded_reference(p: torch.Tensor, grads, lr: float, betas, weight_decay: float):
    """Lion in float32 with each step's parameter rounded to p's dtype (torch's cast: nearest even).
    The constants are formed in float32 as the kernel forms them. Also returns the elements whose
    update direction was within rounding of 0 at some step (a tie: its sign may go either way)."""
    dtype = p.dtype
    p, m = p.detach().clone(), torch.zeros_like(p, dtype=torch.float32)
    beta1, beta2 = _f32(betas[0]), _f32(betas[1])
    decay = 1 - _f32(lr) * _f32(weight_decay)
    tie = torch.zeros_like(m, dtype=torch.bool)
    for g in grads:
        g = g.float()
        direction = beta1 * m + (1 - beta1) * g
        tie |= direction.abs() <= 1e-5 * (m.abs() + g.abs())
        p32 = p.float()
        if weight_decay != 0.0:
            p32 = p32 * decay
        p = (p32 - _f32(lr) * direction.sign()).to(dtype)
        m = beta2 * m + (1 - beta2) * g
    return p, m, tie


def _half_param(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, generator=g).to(dtype).requires_grad_()


def _half_grads(n: int, steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(n, generator=g).to(dtype) for _ in range(steps)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_half_parameters_match_the_float32_reference_rounded(n, dtype, weight_decay):
    # lr 1e-2: an update of 1 lr moves a bfloat16 value of ~1 by about one ulp, so the rounding matters
    p = _half_param(n, dtype)
    start = p.detach().clone()
    grads = _half_grads(n, 10, dtype)
    opt = ds_ops.CPULion([p], lr=1e-2, betas=(0.9, 0.99), weight_decay=weight_decay)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref_p, ref_m, tie = _lion_rounded_reference(start, grads, 1e-2, (0.9, 0.99), weight_decay)
    assert p.dtype == dtype and opt.state[p]["exp_avg"].dtype == torch.float32
    assert tie.sum() <= max(1, n // 1000)
    # bitwise: the float32 value before rounding is the same (decay and +-lr are single roundings in
    # both), and both round to nearest even; only a tie in the sign may go the other way
    assert torch.equal(p.detach()[~tie], ref_p[~tie])
    # the kernel's momentum is one fused multiply-add where the reference rounds twice: an ulp per step
    torch.testing.assert_close(opt.state[p]["exp_avg"], ref_m, rtol=1e-5, atol=1e-6)


def test_half_parameters_change_at_all():
    """A guard on the test above: with lr 1e-2 most bfloat16 elements move in 10 steps."""
    p = _half_param(1000, torch.bfloat16)
    start = p.detach().clone()
    opt = ds_ops.CPULion([p], lr=1e-2)
    for g in _half_grads(1000, 10, torch.bfloat16):
        p.grad = g
        opt.step()
    assert (p.detach() != start).float().mean() > 0.5


def test_states_of_the_parameter_dtype_follow_deepspeeds_flag():
    """DeepSpeedCPULion(params, lr, betas, weight_decay, fp32_optimizer_states): positional order kept."""
    p = _half_param(1003, torch.bfloat16)
    start = p.detach().clone()
    grads = _half_grads(1003, 5, torch.bfloat16)
    opt = ds_ops.CPULion([p], 1e-2, (0.9, 0.99), 0.0, False)
    assert opt.fp32_optimizer_states is False
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16  # stochastically rounded: close, not equal
    ref_p, ref_m, _ = _lion_rounded_reference(start, grads, 1e-2, (0.9, 0.99), 0.0)
    torch.testing.assert_close(opt.state[p]["exp_avg"].float(), ref_m, rtol=2e-2, atol=2e-3)
    assert (p.detach() == ref_p).float().mean() > 0.97  # a sign may flip where bf16 momentum is near 0

    half = _half_param(8, torch.float16)
    half.grad = torch.ones(8, dtype=torch.float16)
    with pytest.raises(ValueError, match="float16 optimizer states are not supported"):
        ds_ops.CPULion([half], fp32_optimizer_states=False).step()
    with pytest.raises(ValueError, match="contradicts state_dtype"):
        ds_ops.CPULion([half], fp32_optimizer_states=False, state_dtype=torch.float32)


def test_float32_parameters_with_bfloat16_states_still_work():
    p = _half_param(1003, torch.float32)
    p.grad = torch.randn(1003)
    opt = ds_ops.CPULion([p], state_dtype=torch.bfloat16)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16


def test_half_parameters_need_gradients_of_their_dtype():
    p = _half_param(8, torch.bfloat16)
    p.grad_dtype = None
    p.grad = torch.randn(8)
    opt = ds_ops.CPULion([p])
    with pytest.raises(ValueError, match=r"is torch\.bfloat16 and its gradient torch\.float32"):
        opt.step()
    assert opt.state[p] == {}


def test_mixed_dtypes_in_one_group():
    params = [_half_param(33, dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16)]
    starts = [p.detach().clone() for p in params]
    grads = [_half_grads(33, 3, p.dtype) for p in params]
    opt = ds_ops.CPULion(params, lr=1e-2)
    for step in range(3):
        for p, g in zip(params, grads, strict=True):
            p.grad = g[step].clone()
        opt.step()
    for p, start, g in zip(params, starts, grads, strict=True):
        ref_p, _, tie = _lion_rounded_reference(start, g, 1e-2, (0.9, 0.999), 0.0)
        assert torch.equal(p.detach()[~tie], ref_p[~tie])


def test_a_state_dict_round_trip_keeps_the_float32_momentum_of_16_bit_parameters():
    p = _half_param(1003, torch.bfloat16)
    opt = ds_ops.CPULion([p], lr=1e-2)
    for g in _half_grads(1003, 3, torch.bfloat16):
        p.grad = g
        opt.step()
    saved = opt.state_dict()
    fresh = ds_ops.CPULion([p], lr=1e-2)
    fresh.load_state_dict(saved)
    momentum = fresh.state[p]["exp_avg"]
    assert momentum.dtype == torch.float32 and torch.equal(momentum, opt.state[p]["exp_avg"])
    assert momentum.data_ptr() != opt.state[p]["exp_avg"].data_ptr()
