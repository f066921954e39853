"""``ds_ops.adam_step`` (the functional Adam on caller-owned buffers) against a float64 Adam/AdamW
written here from the formulas, with the loss scale, the inf/nan flag and the untouched buffers on
overflow; and CPUAdam's DeepSpeed-compatible arguments and 16-bit parameters."""

from __future__ import annotations

import copy

import pytest
import torch

import ds_ops

N = 100003  # many vectors, both threads, and a partial last vector


def _buffers(n: int, seed: int = 0, state_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)


def _scaled_grads(n: int, steps: int, scale: float, dtype, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * scale).to(dtype) for _ in range(steps)]


def _reference(p, grads, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True, scale=1.0,
               bias_correction=True):
    """Adam (L2 decay) / AdamW (decoupled decay) in float64, on grad / scale."""
    p = p.double()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    beta1, beta2 = betas
    for t, grad in enumerate(grads, start=1):
        g = grad.double() / scale
        if adamw:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        bc1, bc2 = (1 - beta1**t, 1 - beta2**t) if bias_correction else (1.0, 1.0)
        p = p - lr / bc1 * m / (v.sqrt() / bc2**0.5 + eps)
    return p, m, v


@pytest.mark.parametrize("n", [7, N])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("grad_scale", [1.0, 1024.0, 3.0])
@pytest.mark.parametrize("adamw, weight_decay", [(True, 0.0), (True, 0.01), (False, 0.01)])
def test_adam_step_matches_a_float64_reference(n, grad_dtype, grad_scale, adamw, weight_decay):
    p, m, v = _buffers(n)
    start = p.clone()
    grads = _scaled_grads(n, 10, grad_scale, grad_dtype)
    kept = [g.clone() for g in grads]
    for step, grad in enumerate(grads, start=1):
        found_inf = ds_ops.adam_step(p, grad, m, v, step, 1e-2, weight_decay=weight_decay, adamw_mode=adamw,
                                     grad_scale=grad_scale)
        assert found_inf is False
    assert all(torch.equal(a, b) for a, b in zip(grads, kept, strict=True))  # the gradients stay scaled
    ref_p, ref_m, ref_v = _reference(start, grads, lr=1e-2, weight_decay=weight_decay, adamw=adamw, scale=grad_scale)
    torch.testing.assert_close(p.double(), ref_p, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.double(), ref_m, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v.double(), ref_v, rtol=1e-5, atol=1e-7)


def test_adam_step_without_bias_correction_and_other_betas():
    p, m, v = _buffers(N)
    start = p.clone()
    grads = _scaled_grads(N, 5, 256.0, torch.bfloat16)
    for step, grad in enumerate(grads, start=1):
        ds_ops.adam_step(p, grad, m, v, step, 1e-3, betas=(0.8, 0.99), eps=1e-6, bias_correction=False,
                         grad_scale=256.0)
    ref_p, *_ = _reference(start, grads, lr=1e-3, betas=(0.8, 0.99), eps=1e-6, scale=256.0, bias_correction=False)
    torch.testing.assert_close(p.double(), ref_p, rtol=1e-5, atol=1e-5)


def test_a_list_of_partitions_is_one_call_with_the_same_result():
    sizes = [5, 4096, 70001]
    parts = [_buffers(n, seed=i) for i, n in enumerate(sizes)]
    alone = [tuple(t.clone() for t in part) for part in parts]
    grads = [_scaled_grads(n, 1, 8.0, torch.float32, seed=10 + i)[0] for i, n in enumerate(sizes)]
    ds_ops.adam_step([p for p, _, _ in parts], grads, [m for _, m, _ in parts], [v for _, _, v in parts], 1, 1e-2,
                     grad_scale=8.0)
    for (p, m, v), grad in zip(alone, grads, strict=True):
        ds_ops.adam_step(p, grad, m, v, 1, 1e-2, grad_scale=8.0)
    for together, single in zip(parts, alone, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(together, single, strict=True))


@pytest.mark.parametrize("copy_dtype", [torch.float16, torch.bfloat16])
def test_half_copy_receives_the_updated_parameters(copy_dtype):
    p, m, v = _buffers(N)
    half = torch.empty(N, dtype=copy_dtype)
    for step, grad in enumerate(_scaled_grads(N, 3, 1024.0, torch.float32), start=1):
        assert ds_ops.adam_step(p, grad, m, v, step, 1e-3, grad_scale=1024.0, half_copy=half) is False
        assert torch.equal(half, p.to(copy_dtype))


def test_bf16_states_follow_the_fp32_ones():
    p32, m32, v32 = _buffers(N)
    p16, m16, v16 = _buffers(N, state_dtype=torch.bfloat16)
    for step, grad in enumerate(_scaled_grads(N, 5, 4.0, torch.float32), start=1):
        ds_ops.adam_step(p32, grad, m32, v32, step, 1e-3, grad_scale=4.0)
        ds_ops.adam_step(p16, grad, m16, v16, step, 1e-3, grad_scale=4.0)
    assert m16.dtype == torch.bfloat16
    torch.testing.assert_close(p16, p32, rtol=0, atol=2e-4)  # 5 steps of lr 1e-3, relative noise 2^-8 each


def _mix32(x: torch.Tensor) -> torch.Tensor:  # uint32 arithmetic in int64, as the kernels' mix32 and hash
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _stochastic_bf16(x: torch.Tensor, noise16: torch.Tensor) -> torch.Tensor:
    """The documented rounding: the 16 noise bits added to the float32 bits, then truncated."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return (((bits + noise16) >> 16) & 0xFFFF).to(torch.int32).to(torch.int16)


def test_bf16_states_round_stochastically_as_documented_bit_for_bit():
    # The first step from zero states is exact float32 arithmetic (m = g*(1-b1), v = g*g*(1-b2)), so the
    # stored bf16 bits follow from the documented noise alone, on every SIMD build: ties and subnormals too
    # (AVX512_BF16's conversion would round ties to even and flush subnormals).
    n, seed, betas = 4099, 12345, (0.9, 0.999)
    g = torch.Generator().manual_seed(5)
    grad = torch.randn(n, generator=g)
    grad[::7] *= 1e-21  # g*g and v subnormal
    grad[::11] = 0.0
    p, m, v = torch.randn(n, generator=g), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    ds_ops.adam_step(p, grad, m, v, 1, 1e-3, betas=betas, seed=seed)
    m32 = grad * torch.tensor(1.0 - betas[0], dtype=torch.float32)
    v32 = (grad * grad) * torch.tensor(1.0 - betas[1], dtype=torch.float32)
    assert (v32[::7] != 0).any() and (v32[::7].abs() < torch.finfo(torch.float32).tiny).all()
    stream = _mix32(torch.tensor(seed ^ int(_mix32(torch.tensor(1))), dtype=torch.int64))  # tensor 0's seed
    counter = (torch.arange(n, dtype=torch.int64) * 0x9E3779B9 + stream) & 0xFFFFFFFF
    noise = counter ^ (counter >> 16)
    noise = (noise * 0x7FEB352D) & 0xFFFFFFFF
    noise = noise ^ (noise >> 15)
    assert torch.equal(m.view(torch.int16), _stochastic_bf16(m32, noise & 0xFFFF))
    assert torch.equal(v.view(torch.int16), _stochastic_bf16(v32, noise >> 16))


# ---- overflow ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [0, N // 2, N - 1])  # first vector, middle (second thread), partial last vector
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_overflow_is_reported_and_nothing_is_written(bad, where, grad_dtype):
    p, m, v = _buffers(N)
    half = torch.empty(N, dtype=torch.float16)
    first = _scaled_grads(N, 1, 1024.0, grad_dtype)[0]
    ds_ops.adam_step(p, first, m, v, 1, 1e-2, grad_scale=1024.0, half_copy=half)  # states hold values now
    before = [t.clone() for t in (p, m, v, half)]
    grad = _scaled_grads(N, 1, 1024.0, grad_dtype, seed=2)[0]
    grad[where] = bad
    assert ds_ops.adam_step(p, grad, m, v, 2, 1e-2, grad_scale=1024.0, half_copy=half) is True
    for after, kept in zip((p, m, v, half), before, strict=True):
        assert torch.equal(after, kept)
    assert ds_ops.has_inf_or_nan(grad)
    # the caller skips the step: the next finite one is step 2, as if the bad one never came
    good = _scaled_grads(N, 1, 1024.0, grad_dtype, seed=3)[0]
    assert ds_ops.adam_step(p, good, m, v, 2, 1e-2, grad_scale=1024.0) is False
    ref_p, _, _ = _reference(_buffers(N)[0], [first, good], lr=1e-2, scale=1024.0)
    torch.testing.assert_close(p.double(), ref_p, rtol=1e-5, atol=1e-5)


def test_finite_gradients_that_overflow_when_unscaled_count_as_overflow():
    p, m, v = _buffers(1000)
    grad = torch.full((1000,), 1e10)
    assert ds_ops.adam_step(p, grad, m, v, 1, 1e-3, grad_scale=1e-30) is True  # 1e10 * 1e30 > float32 max
    assert torch.equal(m, torch.zeros(1000))
    assert ds_ops.has_inf_or_nan(grad, grad_scale=1e-30) and not ds_ops.has_inf_or_nan(grad)


def test_without_the_check_one_pass_still_reports_the_overflow():
    """check_finite=False is for callers that decided beforehand (a global check over ranks); the
    flag still comes back, and the update has been written."""
    p, m, v = _buffers(N)
    grad = torch.randn(N)
    grad[N // 3] = float("nan")
    assert ds_ops.adam_step(p, grad, m, v, 1, 1e-2, check_finite=False) is True
    assert torch.isnan(p[N // 3]) and torch.isnan(m[N // 3])
    q, m2, v2 = _buffers(N)
    assert ds_ops.adam_step(q, torch.randn(N), m2, v2, 1, 1e-2, check_finite=False) is False


def test_has_inf_or_nan_over_lists_and_dtypes():
    clean = [torch.randn(n).to(d) for n, d in ((3, torch.float32), (50000, torch.bfloat16), (17, torch.float16))]
    assert not ds_ops.has_inf_or_nan(clean)
    for i in range(3):
        dirty = [t.clone() for t in clean]
        dirty[i][-1] = float("inf")
        assert ds_ops.has_inf_or_nan(dirty), i
    assert not ds_ops.has_inf_or_nan(torch.full((10,), 60000.0, dtype=torch.float16))  # large is not inf


# ---- bad input ----------------------------------------------------------------------------------

def _call(**changes):
    args = {"params": torch.zeros(8), "grads": torch.zeros(8), "exp_avg": torch.zeros(8),
            "exp_avg_sq": torch.zeros(8), "step": 1, "lr": 1e-3}
    args.update(changes)
    return ds_ops.adam_step(**args)


@pytest.mark.parametrize("changes, message", [
    ({"grads": torch.zeros(4)}, r"grads\[0\] has 4 elements, its parameter 8"),
    ({"exp_avg": torch.zeros(8, dtype=torch.float16)}, r"exp_avg\[0\] is torch\.float16; allowed: torch\.float32, "
                                                        r"torch\.bfloat16"),
    ({"params": torch.zeros(8, dtype=torch.float64)}, r"params\[0\] is torch\.float64"),
    ({"grads": torch.zeros(16)[::2]}, r"grads\[0\] must be a contiguous dense CPU tensor.*not contiguous"),
    ({"grads": torch.zeros(8).to_sparse()}, r"grads\[0\] must be a contiguous dense CPU tensor, got torch\.sparse_coo"),
    ({"grads": [torch.zeros(8), torch.zeros(8)]}, "grads has 2 tensors, params 1"),
    ({"params": [torch.zeros(8), torch.zeros(4)], "grads": [torch.zeros(8), torch.zeros(4, dtype=torch.bfloat16)],
      "exp_avg": [torch.zeros(8), torch.zeros(4)], "exp_avg_sq": [torch.zeros(8), torch.zeros(4)]},
     "the tensors of grads must share one dtype, got torch.bfloat16, torch.float32"),
    ({"params": torch.zeros(8, dtype=torch.bfloat16)}, r"params\[0\] is torch\.bfloat16 and grads\[0\] torch\.float32"),
    ({"params": torch.zeros(8, dtype=torch.bfloat16), "grads": torch.zeros(8, dtype=torch.bfloat16),
      "half_copy": torch.zeros(8, dtype=torch.float16)}, "half_copy is for float32 parameters"),
    ({"half_copy": torch.zeros(8)}, r"half_copy\[0\] is torch\.float32"),
    ({"step": 0}, r"step must be an integer >= 1 \(this step's number\), got 0"),
    ({"step": 1.5}, "step must be an integer >= 1"),
    ({"step": float("inf")}, "step must be an integer >= 1"),
    ({"grad_scale": 0.0}, r"grad_scale must be a number in \[1e-30, 1e30\] \(the loss scale\), got 0.0"),
    ({"grad_scale": float("nan")}, "grad_scale must be a number"),
    ({"lr": -1.0}, "adam_step: lr must be >= 0"),
    ({"params": []}, "params must be a tensor or a non-empty list of tensors, got list"),
])
def test_bad_input_is_named_and_nothing_is_written(changes, message):
    with pytest.raises(ValueError, match=message):
        _call(**changes)


def test_a_loss_scale_tensor_is_taken():
    p, m, v = _buffers(16)
    q, m2, v2 = _buffers(16)
    grad = torch.randn(16) * 64
    ds_ops.adam_step(p, grad, m, v, 1, 1e-2, grad_scale=torch.tensor(64.0))
    ds_ops.adam_step(q, grad, m2, v2, 1, 1e-2, grad_scale=64.0)
    assert torch.equal(p, q)


# ---- CPUAdam: DeepSpeed's arguments, 16-bit parameters -----------------------------------------

def test_cpu_adam_takes_deepspeeds_positional_arguments_and_attributes():
    p = torch.zeros(4, requires_grad=True)
    # DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode,
    #                  fp32_optimizer_states)
    opt = ds_ops.CPUAdam([p], 1e-3, True, (0.9, 0.999), 1e-8, 0.0, False, False, True)
    assert opt.adam_w_mode is False and opt.adamw_mode is False and opt.fp32_optimizer_states is True
    opt.adam_w_mode = True
    assert opt.adamw_mode is True
    assert ds_ops.CPUAdam([p], fp32_optimizer_states=False).fp32_optimizer_states is False
    assert ds_ops.FusedAdam([p], adam_w_mode=False).adam_w_mode is False
    with pytest.raises(ValueError, match=r"fp32_optimizer_states=True contradicts state_dtype=torch\.bfloat16"):
        ds_ops.CPUAdam([p], fp32_optimizer_states=True, state_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"fp32_optimizer_states must be True or False, got torch\.bfloat16"):
        ds_ops.CPUAdam([p], 1e-3, True, (0.9, 0.999), 1e-8, 0.0, False, True, torch.bfloat16)


def _mirror_16bit(p16, grads, lr, weight_decay):
    """AdamW in float64 with the parameter rounded to its 16-bit dtype after every step (what an
    optimizer that keeps 16-bit parameters and float32 states does)."""
    p = p16.clone()
    m = torch.zeros(p.shape, dtype=torch.float64)
    v = torch.zeros(p.shape, dtype=torch.float64)
    for t, grad in enumerate(grads, start=1):
        x, g = p.double() * (1 - lr * weight_decay), grad.double()
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        p = (x - lr / (1 - 0.9**t) * m / (v.sqrt() / (1 - 0.999**t) ** 0.5 + 1e-8)).to(p16.dtype)
    return p, m, v


@pytest.mark.parametrize("dtype, ulp", [(torch.bfloat16, 2.0**-7), (torch.float16, 2.0**-10)])
def test_cpu_adam_updates_16bit_parameters_in_place(dtype, ulp):
    n = 20011
    g = torch.Generator().manual_seed(4)
    p = torch.randn(n, generator=g).to(dtype).requires_grad_()
    start = p.detach().clone()
    grads = [torch.randn(n, generator=g).to(dtype) for _ in range(5)]
    opt = ds_ops.CPUAdam([p], lr=1e-2, weight_decay=0.01)
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
    assert p.dtype == dtype and opt.state[p]["exp_avg"].dtype == torch.float32
    ref_p, ref_m, _ = _mirror_16bit(start, grads, 1e-2, 0.01)
    torch.testing.assert_close(opt.state[p]["exp_avg"].double(), ref_m, rtol=1e-5, atol=1e-6)
    same = torch.eq(p.detach(), ref_p).float().mean().item()
    assert same > 0.999, same  # float32 vs float64 arithmetic decides a rounding now and then ...
    torch.testing.assert_close(p.detach().double(), ref_p.double(), rtol=ulp, atol=ulp)  # ... by one unit
    assert torch.ne(p.detach(), start).float().mean().item() > 0.5  # the steps did move the parameters


def test_fp32_optimizer_states_false_keeps_states_in_the_parameters_dtype():
    p = torch.randn(1000).to(torch.bfloat16).requires_grad_()
    p.grad = torch.randn(1000).to(torch.bfloat16)
    opt = ds_ops.CPUAdam([p], fp32_optimizer_states=False)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
    q = torch.randn(8, requires_grad=True)
    q.grad = torch.randn(8)
    fp32 = ds_ops.CPUAdam([q], fp32_optimizer_states=False)
    fp32.step()
    assert fp32.state[q]["exp_avg"].dtype == torch.float32
    h = torch.randn(8).half().requires_grad_()
    h.grad = torch.randn(8).half()
    with pytest.raises(ValueError, match=r"float16 optimizer states are not supported .* use "
                                         r"fp32_optimizer_states=True or state_dtype=torch\.bfloat16"):
        ds_ops.CPUAdam([h], fp32_optimizer_states=False).step()


def test_16bit_parameters_keep_float32_states_through_a_checkpoint():
    p = torch.randn(1000).to(torch.bfloat16).requires_grad_()
    p.grad = torch.randn(1000).to(torch.bfloat16)
    opt = ds_ops.CPUAdam([p], lr=1e-3)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    fresh = ds_ops.CPUAdam([p], lr=1e-3)
    fresh.load_state_dict(saved)  # torch would cast the states to bfloat16
    assert fresh.state[p]["exp_avg_sq"].dtype == torch.float32
    assert torch.equal(fresh.state[p]["exp_avg_sq"], saved["state"][0]["exp_avg_sq"])


def test_16bit_parameter_with_a_float32_gradient_is_refused():
    p = torch.randn(8).to(torch.bfloat16).requires_grad_()
    p.grad_dtype = None
    p.grad = torch.randn(8)
    with pytest.raises(ValueError, match=r"is torch\.bfloat16 and its gradient torch\.float32; a 16-bit parameter needs"):
        ds_ops.CPUAdam([p]).step()
