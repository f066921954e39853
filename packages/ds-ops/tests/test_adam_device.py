"""The device path of ``adam_step``, FusedAdam and FusedLamb (torch's fused multi-tensor Adam, the
step without bias correction in foreach ops, the 16-bit staging): run here on CPU tensors through
the same code, against torch.optim.Adam/AdamW, a float64 reference and the C++ ``cpu_adam``/``cpu_lamb``
kernels. The ``cuda``-marked tests run it on a GPU against ``torch.optim.AdamW(fused=True)``."""

from __future__ import annotations

import pytest
import torch

import ds_ops
from ds_ops import _adam_device
from ds_ops.adam import _torch_adam_step

N = 10007
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _grads(n: int, steps: int, scale: float, dtype, seed: int = 1, device="cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * scale).to(device=device, dtype=dtype) for _ in range(steps)]


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


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_scale", [1.0, 1024.0, 3.0])
@pytest.mark.parametrize("adamw, weight_decay", [(True, 0.0), (True, 0.01), (False, 0.01)])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_torch_path_matches_the_reference_and_the_cpu_kernel(grad_dtype, grad_scale, adamw, weight_decay,
                                                             bias_correction):
    start = torch.randn(N, generator=torch.Generator().manual_seed(0))
    p, m, v = start.clone(), torch.zeros(N), torch.zeros(N)
    q, m2, v2 = start.clone(), torch.zeros(N), torch.zeros(N)
    half, half2 = torch.empty(N, dtype=torch.bfloat16), torch.empty(N, dtype=torch.bfloat16)
    grads = _grads(N, 6, grad_scale, grad_dtype)
    kept = [g.clone() for g in grads]
    options = {"weight_decay": weight_decay, "adamw_mode": adamw, "bias_correction": bias_correction,
               "grad_scale": grad_scale}
    for step, grad in enumerate(grads, start=1):
        assert _torch_adam_step(p, grad, m, v, step, 1e-2, half_copy=half, **options) is False
        assert ds_ops.adam_step(q, grad, m2, v2, step, 1e-2, half_copy=half2, **options) is False
        assert torch.equal(half, p.to(torch.bfloat16))
    assert all(torch.equal(a, b) for a, b in zip(grads, kept, strict=True))  # the gradients stay scaled
    ref_p, ref_m, ref_v = _reference(start, grads, lr=1e-2, weight_decay=weight_decay, adamw=adamw, scale=grad_scale,
                                     bias_correction=bias_correction)
    torch.testing.assert_close(p.double(), ref_p, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.double(), ref_m, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v.double(), ref_v, rtol=1e-5, atol=1e-7)
    for ours, kernel in ((p, q), (m, m2), (v, v2)):  # the C++ kernel and torch's agree to float32 rounding
        torch.testing.assert_close(ours, kernel, rtol=2e-6, atol=1e-6)
    assert (half.float() - half2.float()).abs().max() <= (half2.float().abs().max() * 2**-7)


@pytest.mark.parametrize("adamw", [True, False])
def test_torch_path_is_torch_optims_adam(adamw):
    params = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate((5, 4099, 300))]
    reference = [p.clone().requires_grad_() for p in params]
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)(reference, lr=3e-3, betas=(0.8, 0.99), eps=1e-6,
                                                              weight_decay=0.02)
    ms, vs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for step in range(1, 5):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i))
                 for i, p in enumerate(params)]
        for r, g in zip(reference, grads, strict=True):
            r.grad = g.clone()
        opt.step()
        _torch_adam_step(params, grads, ms, vs, step, 3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.02,
                         adamw_mode=adamw)
    for ours, r in zip(params, reference, strict=True):
        torch.testing.assert_close(ours, r.detach(), rtol=1e-6, atol=1e-7)
    for ours, r in zip(ms, reference, strict=True):
        torch.testing.assert_close(ours, opt.state[r]["exp_avg"], rtol=1e-6, atol=1e-8)


def _bf16_model_against_torchs_fused_adamw(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A bf16 model with bf16 gradients and states (what ds-zero's bf16 master weights step): ours
    and torch.optim.AdamW(fused=True) on the same model, which keeps its states in bf16 too."""
    shapes = [(4096, 3), (7,)]
    params = [torch.randn(s, generator=torch.Generator().manual_seed(i)).to(device, torch.bfloat16).reshape(-1)
              for i, s in enumerate(shapes)]
    reference = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(reference, lr=1e-3, weight_decay=0.01, fused=True)
    ms, vs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for step in range(1, 4):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(9 * step + i)).to(device, torch.bfloat16)
                 for i, p in enumerate(params)]
        for r, g in zip(reference, grads, strict=True):
            r.grad = g.clone()
        opt.step()
        _torch_adam_step(params, grads, ms, vs, step, 1e-3, weight_decay=0.01)
    pairs = list(zip(params, [r.detach() for r in reference], strict=True))
    pairs += list(zip(ms, [opt.state[r]["exp_avg"] for r in reference], strict=True))
    return pairs


def test_a_bf16_model_steps_as_torchs_fused_adamw_bit_for_bit():
    for ours, theirs in _bf16_model_against_torchs_fused_adamw("cpu"):
        assert ours.dtype == theirs.dtype == torch.bfloat16 and torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_parameters_are_updated_in_float32_as_the_cpu_kernel(dtype):
    start = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(dtype)
    p, q = start.clone(), start.clone()
    states = [torch.zeros(N) for _ in range(4)]
    for step, grad in enumerate(_grads(N, 4, 1.0, dtype), start=1):
        _torch_adam_step(p, grad, states[0], states[1], step, 1e-2, weight_decay=0.01)
        ds_ops.adam_step(q, grad, states[2], states[3], step, 1e-2, weight_decay=0.01)
    assert p.dtype == dtype and not torch.equal(p, start)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    assert ((p.float() - q.float()).abs() <= q.float().abs() * ulp + 1e-6).all()  # at most one rounding apart
    torch.testing.assert_close(states[0], states[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grad_dtype, grad_scale, bias_correction", [
    (torch.bfloat16, 1.0, True), (torch.float32, 8.0, True), (torch.float32, 1.0, False)])
def test_staging_in_batches_changes_only_float32_rounding(monkeypatch, grad_dtype, grad_scale, bias_correction):
    sizes = [250, 3, 1000, 0, 77]
    starts = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in sizes]
    grads = [(torch.randn(n, generator=torch.Generator().manual_seed(n + 1)) * grad_scale).to(grad_dtype)
             for n in sizes]
    results = []
    for chunk in (_adam_device.CHUNK, 100, 7):
        monkeypatch.setattr(_adam_device, "CHUNK", chunk)
        ps = [s.clone() for s in starts]
        ms, vs = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
        halves = [torch.empty(n, dtype=torch.float16) for n in sizes]
        for step in (1, 2):
            _torch_adam_step(ps, grads, ms, vs, step, 1e-2, grad_scale=grad_scale, bias_correction=bias_correction,
                             half_copy=halves)
        results.append(ps + ms + vs + halves)
    assert not torch.equal(results[0][0], starts[0])
    for other in results[1:]:  # torch's CPU kernel rounds a vector body and a scalar tail differently
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_batches_cover_every_element_once():
    sizes = [250, 3, 0, 1000, 77]
    batches = list(_adam_device._batches(sizes, 100))
    assert all(sum(b - a for _, a, b in batch) <= 100 for batch in batches)
    covered = [[] for _ in sizes]
    for batch in batches:
        for i, a, b in batch:
            covered[i].extend(range(a, b))
    assert covered == [list(range(n)) for n in sizes]


@pytest.mark.parametrize("bad, grad_scale", [(float("nan"), 1.0), (float("inf"), 1.0), (-float("inf"), 4.0),
                                             (1e38, 1e-3)])  # finite, but inf once unscaled
def test_overflow_writes_nothing_and_is_reported(bad, grad_scale):
    p, m, v = torch.randn(N), torch.zeros(N), torch.zeros(N)
    half = torch.zeros(N, dtype=torch.bfloat16)
    grad = torch.randn(N)
    grad[N // 2] = bad
    before = [t.clone() for t in (p, m, v, half)]
    assert _torch_adam_step(p, grad, m, v, 1, 1e-2, grad_scale=grad_scale, half_copy=half) is True
    assert all(torch.equal(a, b) for a, b in zip((p, m, v, half), before, strict=True))
    assert _torch_adam_step(p, grad, m, v, 1, 1e-2, grad_scale=grad_scale, check_finite=False) is True
    assert not torch.equal(p, before[0])  # written: the caller asked for no check
    assert _adam_device.found_non_finite([torch.ones(3), grad.bfloat16()], grad_scale)
    assert not _adam_device.found_non_finite([torch.ones(3), torch.zeros(0)], 1.0)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_bf16_states_round_to_nearest_and_follow_the_fp32_ones(param_dtype):
    start = torch.randn(N, generator=torch.Generator().manual_seed(4)).to(param_dtype)
    p, q = start.clone(), start.clone()
    m16, v16 = torch.zeros(N, dtype=torch.bfloat16), torch.zeros(N, dtype=torch.bfloat16)
    m32, v32 = torch.zeros(N), torch.zeros(N)
    for step, grad in enumerate(_grads(N, 5, 1.0, param_dtype), start=1):
        _torch_adam_step(p, grad, m16, v16, step, 1e-3)
        _torch_adam_step(q, grad, m32, v32, step, 1e-3)
    assert m16.dtype == v16.dtype == torch.bfloat16 and p.dtype == param_dtype
    torch.testing.assert_close(m16.float(), m32, rtol=2**-6, atol=4e-3)  # a few bf16 roundings of |m| <= ~1
    torch.testing.assert_close(p.float(), q.float(), rtol=2**-7, atol=1e-3)
    # one step from zero states: exactly the float32 states rounded to nearest
    m16.zero_(), v16.zero_(), m32.zero_(), v32.zero_()
    grad = _grads(N, 1, 1.0, param_dtype, seed=9)[0]
    _torch_adam_step(p.clone(), grad, m16, v16, 1, 1e-3)
    _torch_adam_step(q.clone(), grad, m32, v32, 1, 1e-3)
    assert torch.equal(m16, m32.to(torch.bfloat16)) and torch.equal(v16, v32.to(torch.bfloat16))


def test_torch_path_refuses_a_tensor_on_another_device():
    args = [torch.zeros(8), torch.zeros(8), torch.zeros(8, device="meta"), torch.zeros(8), 1, 1e-3]
    with pytest.raises(ValueError, match=r"exp_avg\[0\] must be a contiguous dense CPU tensor, got .* on meta"):
        _torch_adam_step(*args)
    args[2] = torch.zeros(8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"exp_avg\[0\] is torch\.float16; allowed: torch\.float32, torch\.bfloat16"):
        _torch_adam_step(*args)


# ---- FusedAdam and FusedLamb through the device path ----------------------------------------------------

def _params(shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _train(opt, params, steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype)
        opt.step()


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_device_path_is_torch_optims_adam(adam_w_mode):
    shapes = [(33, 7), (4099,), (1,)]
    ours, theirs = _params(shapes), _params(shapes)
    opt = ds_ops.FusedAdam(ours, lr=1e-2, weight_decay=0.01, adam_w_mode=adam_w_mode)
    opt._torch_path = True
    reference = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(theirs, lr=1e-2, weight_decay=0.01)
    _train(opt, ours, 5)
    _train(reference, theirs, 5)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
        assert opt.state[a]["step"].item() == 5.0 and opt.state[a]["step"].device == a.device


@pytest.mark.parametrize("dtype, bias_correction", [(torch.float32, False), (torch.bfloat16, True)])
def test_fused_adam_device_path_is_its_cpu_path(dtype, bias_correction):
    shapes = [(33, 7), (4099,)]
    ours, cpu = _params(shapes, dtype), _params(shapes, dtype)
    opt = ds_ops.FusedAdam(ours, lr=1e-2, weight_decay=0.01, bias_correction=bias_correction)
    opt._torch_path = True
    _train(opt, ours, 4)
    _train(ds_ops.FusedAdam(cpu, lr=1e-2, weight_decay=0.01, bias_correction=bias_correction), cpu, 4)
    ulp = 1e-6 if dtype == torch.float32 else 2**-7
    for a, b in zip(ours, cpu, strict=True):
        assert a.dtype == dtype and opt.state[a]["exp_avg"].dtype == torch.float32
        assert ((a.float() - b.float()).abs() <= b.float().abs() * ulp + 1e-6).all()


def test_fused_adam_device_path_keeps_bf16_states_when_asked():
    shapes = [(33, 7), (4099,)]
    ours, cpu = _params(shapes), _params(shapes)
    opt = ds_ops.FusedAdam(ours, lr=1e-2, state_dtype=torch.bfloat16)
    opt._torch_path = True
    kernel = ds_ops.FusedAdam(cpu, lr=1e-2, state_dtype=torch.bfloat16)  # stochastic rounding on CPU
    _train(opt, ours, 4)
    _train(kernel, cpu, 4)
    for a, b in zip(ours, cpu, strict=True):
        assert opt.state[a]["exp_avg"].dtype == opt.state[a]["exp_avg_sq"].dtype == torch.bfloat16
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-3, atol=1e-3)


def test_fused_adam_device_path_refuses_what_it_cannot_do():
    p = _params([(8,)])[0]
    opt = ds_ops.FusedAdam([p])
    opt._torch_path = True
    p.grad = torch.zeros(16)[::2]
    with pytest.raises(ValueError, match=r"has a gradient that is torch\.float32, torch\.strided, not contiguous"):
        opt.step()
    assert not opt.state[p]  # nothing touched


@pytest.mark.parametrize("options", [{}, {"weight_decay": 0.01}, {"bias_correction": False, "eps_inside_sqrt": True},
                                     {"max_coeff": 0.5}, {"max_grad_norm": 1.0}])
def test_fused_lamb_device_path_is_its_cpu_kernel(options):
    shapes = [(1003,), (7,), (33, 3)]
    ours, cpu = _params(shapes), _params(shapes)
    opt = ds_ops.FusedLamb(ours, lr=1e-2, **options)
    opt._torch_path = True
    kernel = ds_ops.FusedLamb(cpu, lr=1e-2, **options)
    _train(opt, ours, 4)
    _train(kernel, cpu, 4)
    for a, b in zip(ours, cpu, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    assert len(opt.lamb_coeffs) == 3 and all(isinstance(c, float) for c in opt.lamb_coeffs)
    assert opt.lamb_coeffs == pytest.approx(kernel.lamb_coeffs, rel=1e-4)


def test_fused_lamb_device_path_refuses_bf16_states():
    p = _params([(8,)])[0]
    p.grad = torch.ones(8)
    opt = ds_ops.FusedLamb([p], state_dtype=torch.bfloat16)
    opt._torch_path = True
    with pytest.raises(ValueError, match=r"state_dtype=torch\.bfloat16 is supported for CPU tensors only"):
        opt.step()


# ---- on a GPU (scripts/gpu_check.sh) -------------------------------------------------------------------------

@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("adamw", [True, False])
def test_cuda_adam_step_is_torchs_fused_adamw(adamw):
    shapes = [(4096, 33), (7,), (1 << 20,)]
    params = [torch.randn(s, device="cuda").reshape(-1) for s in shapes]
    reference = [p.clone().requires_grad_() for p in params]
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)(reference, lr=1e-3, weight_decay=0.01, fused=True)
    ms, vs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    halves = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    for step in range(1, 4):
        grads = [torch.randn(p.shape, device="cuda") * 1024 for p in params]
        for r, g in zip(reference, grads, strict=True):
            r.grad = g / 1024
        opt.step()
        assert ds_ops.adam_step(params, grads, ms, vs, step, 1e-3, weight_decay=0.01, adamw_mode=adamw,
                                grad_scale=1024.0, half_copy=halves) is False
    for ours, r, half in zip(params, reference, halves, strict=True):
        torch.testing.assert_close(ours, r.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(half, ours.to(torch.bfloat16))


@pytest.mark.cuda
@cuda
def test_cuda_a_bf16_model_steps_as_torchs_fused_adamw_bit_for_bit():
    for ours, theirs in _bf16_model_against_torchs_fused_adamw("cuda"):
        assert ours.is_cuda and ours.dtype == theirs.dtype == torch.bfloat16 and torch.equal(ours, theirs)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_cuda_adam_step_is_the_cpu_kernel(grad_dtype, bias_correction):
    start = torch.randn(N)
    p, m, v = start.cuda(), torch.zeros(N, device="cuda"), torch.zeros(N, device="cuda")
    q, m2, v2 = start.clone(), torch.zeros(N), torch.zeros(N)
    for step, grad in enumerate(_grads(N, 4, 256.0, grad_dtype), start=1):
        kept = grad.cuda()
        assert ds_ops.adam_step(p, kept, m, v, step, 1e-2, weight_decay=0.01, grad_scale=256.0,
                                bias_correction=bias_correction) is False
        assert torch.equal(kept.cpu(), grad)
        ds_ops.adam_step(q, grad, m2, v2, step, 1e-2, weight_decay=0.01, grad_scale=256.0,
                         bias_correction=bias_correction)
    torch.testing.assert_close(p.cpu(), q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v.cpu(), v2, rtol=1e-5, atol=1e-9)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_cuda_overflow_writes_nothing(bad):
    p, m, v = torch.randn(N, device="cuda"), torch.zeros(N, device="cuda"), torch.zeros(N, device="cuda")
    grad = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    grad[N - 1] = bad
    before = p.clone()
    assert ds_ops.has_inf_or_nan(grad) and ds_ops.has_inf_or_nan([torch.ones(3, device="cuda"), grad])
    assert ds_ops.adam_step(p, grad, m, v, 1, 1e-2) is True
    assert torch.equal(p, before) and not m.any()


@pytest.mark.cuda
@cuda
def test_cuda_fused_adam_is_torchs_fused_adamw_and_keeps_fp32_states_for_bf16():
    shapes = [(256, 64), (4099,)]
    ours = [p.cuda().detach().requires_grad_() for p in _params(shapes)]
    theirs = [p.cuda().detach().requires_grad_() for p in _params(shapes)]
    opt = ds_ops.FusedAdam(ours, lr=1e-3, weight_decay=0.01)
    reference = torch.optim.AdamW(theirs, lr=1e-3, weight_decay=0.01, fused=True)
    _train(opt, ours, 5)
    _train(reference, theirs, 5)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    half = [p.cuda().to(torch.bfloat16).detach().requires_grad_() for p in _params(shapes)]
    opt = ds_ops.FusedAdam(half, lr=1e-3)
    _train(opt, half, 2)
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 and p.dtype == torch.bfloat16 for p in half)


@pytest.mark.cuda
@cuda
def test_cuda_fused_lamb_is_its_cpu_kernel():
    shapes = [(1003,), (33, 3)]
    ours = [p.cuda().detach().requires_grad_() for p in _params(shapes)]
    cpu = _params(shapes)
    opt, kernel = ds_ops.FusedLamb(ours, lr=1e-2, weight_decay=0.01), ds_ops.FusedLamb(cpu, lr=1e-2, weight_decay=0.01)
    _train(opt, ours, 3)
    _train(kernel, cpu, 3)
    for a, b in zip(ours, cpu, strict=True):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-5, atol=1e-6)
    assert opt.lamb_coeffs == pytest.approx(kernel.lamb_coeffs, rel=1e-4)


@pytest.mark.cuda
@cuda
def test_cuda_pinned_memory_from_the_seam():
    acc = ds_ops.get_accelerator()
    host = acc.pin_memory(torch.arange(1 << 16, dtype=torch.float32))
    assert acc.is_pinned(host) and host.is_pinned()
    device = torch.empty(1 << 16, device=acc.device())
    stream = acc.Stream()
    with acc.stream(stream):
        device.copy_(host, non_blocking=True)
        done = acc.Event()
        done.record(stream)
    done.synchronize()
    assert torch.equal(device.cpu(), host)
