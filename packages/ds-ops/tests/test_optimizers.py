"""The CPU optimizers against torch's own optimizers and against references written in torch."""

from __future__ import annotations

import copy

import pytest
import torch

import ds_ops

SIZES = [1, 7, 1000003]  # a scalar, a vector tail only, and many vectors plus a tail
GRAD_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _param(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g).requires_grad_()
    p.grad_dtype = None  # allow 16-bit gradients on a float32 parameter (what ZeRO-Offload hands in)
    return p


def _grads(n: int, steps: int, dtype: torch.dtype, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for _ in range(steps)]


def _run(optimizer, param, grads):
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("adamw", [True, False])
def test_cpu_adam_matches_torch_adam(n, grad_dtype, weight_decay, adamw):
    ours, ref = _param(n), _param(n)
    grads = _grads(n, 20, grad_dtype)
    opt = ds_ops.CPUAdam([ours], lr=1e-2, weight_decay=weight_decay, adamw_mode=adamw)
    ref_opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([ref], lr=1e-2, weight_decay=weight_decay)
    _run(opt, ours, grads)
    _run(ref_opt, ref, [g.float() for g in grads])  # the kernel reads 16-bit grads exactly as .float()
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-5, atol=1e-5)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(opt.state[ours][key], ref_opt.state[ref][key], rtol=1e-5, atol=1e-6)
    assert float(opt.state[ours]["step"]) == 20.0


def test_cpu_adam_without_bias_correction_matches_the_formula():
    ours, ref = _param(1000), _param(1000)
    grads = _grads(1000, 10, torch.float32)
    opt = ds_ops.CPUAdam([ours], lr=1e-2, bias_correction=False, weight_decay=0.1)
    _run(opt, ours, grads)
    m, v = torch.zeros(1000), torch.zeros(1000)
    with torch.no_grad():
        for g in grads:
            ref.mul_(1 - 1e-2 * 0.1)
            m.mul_(0.9).add_(g, alpha=0.1)
            v.mul_(0.999).addcmul_(g, g, value=0.001)
            ref.addcdiv_(m, v.sqrt() + 1e-8, value=-1e-2)
    torch.testing.assert_close(ours.detach(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("copy_dtype", [torch.float16, torch.bfloat16])
def test_half_copy_is_the_fp32_result_rounded(copy_dtype):
    p = _param(100003)
    copy_out = torch.empty(100003, dtype=copy_dtype)
    opt = ds_ops.CPUAdam([p], lr=1e-3)
    for g in _grads(100003, 3, torch.float32):
        p.grad = g
        opt.step(fp16_param_groups=[[copy_out]])
        assert torch.equal(copy_out, p.detach().to(copy_dtype))


def test_fused_adam_updates_many_tensors_like_torch():
    shapes = [(3,), (17, 5), (1000,), (64, 64), (1,), (2, 3, 4)] * 10
    g = torch.Generator().manual_seed(3)
    ours = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = ds_ops.FusedAdam(ours, lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.01)
    for _ in range(10):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for p, q, grad in zip(ours, ref, grads, strict=True):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-5)
    opt.zero_grad()
    assert all(p.grad is None for p in ours)  # set_grad_none=True, as DeepSpeed's


def test_state_dict_moves_between_cpu_adam_and_torch_adam():
    a, b = _param(1000), _param(1000)
    grads = _grads(1000, 10, torch.float32)
    ours = ds_ops.CPUAdam([a], lr=1e-2, adamw_mode=False)
    _run(ours, a, grads[:5])
    # ours -> torch: continue both for 5 steps
    torch_opt = torch.optim.Adam([b], lr=1e-2)
    with torch.no_grad():
        b.copy_(a)
    torch_opt.load_state_dict(copy.deepcopy(ours.state_dict()))
    _run(ours, a, grads[5:])
    _run(torch_opt, b, grads[5:])
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5)
    # torch -> ours
    c = _param(1000)
    with torch.no_grad():
        c.copy_(b)
    back = ds_ops.CPUAdam([c], lr=1e-2, adamw_mode=False)
    back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))  # a live state_dict shares its tensors
    _run(back, c, grads[:3])
    _run(torch_opt, b, grads[:3])
    torch.testing.assert_close(c.detach(), b.detach(), rtol=1e-5, atol=1e-5)
    assert back.state[c]["exp_avg"].dtype == torch.float32


def test_bf16_states_say_their_dtype_and_survive_a_round_trip():
    p = _param(4096)
    opt = ds_ops.CPUAdam([p], lr=1e-3, state_dtype=torch.bfloat16)
    _run(opt, p, _grads(4096, 2, torch.float32))
    state = opt.state_dict()
    assert state["param_groups"][0]["state_dtype"] == "bfloat16"
    assert state["state"][0]["exp_avg"].dtype == torch.bfloat16
    fresh = ds_ops.CPUAdam([p], lr=1e-3, state_dtype=torch.bfloat16)
    fresh.load_state_dict(state)  # torch casts loaded state to the parameter's dtype ...
    _run(fresh, p, _grads(4096, 1, torch.float32))
    assert fresh.state[p]["exp_avg"].dtype == torch.bfloat16  # ... and we keep bf16 regardless


def test_bf16_stochastic_rounding_is_unbiased():
    """With beta1 = 0, exp_avg = g exactly before it is stored; 1/3 is not a bf16 number, so
    round-to-nearest would be off by a fixed bias while stochastic rounding averages to 1/3."""
    n = 1 << 20
    p = torch.zeros(n, requires_grad=True)
    p.grad = torch.full((n,), 1.0 / 3.0)
    opt = ds_ops.CPUAdam([p], lr=0.0, betas=(0.0, 0.999), state_dtype=torch.bfloat16)
    opt.step()
    stored = opt.state[p]["exp_avg"].float()
    bits = torch.tensor(1.0 / 3.0).view(torch.int32) & ~0xFFFF
    below, above = bits.view(torch.float32).item(), (bits + 0x10000).view(torch.float32).item()
    assert set(stored.unique().tolist()) == {below, above}  # the two bf16 neighbours of 1/3
    bias = stored.mean().item() - 1.0 / 3.0
    assert abs(bias) < 2e-5, bias
    nearest = torch.tensor(1.0 / 3.0).bfloat16().float().item()
    assert abs(nearest - 1.0 / 3.0) > 5e-4  # what round-to-nearest would have cost


def test_bf16_states_train_as_well_as_fp32_adam():
    """A small regression model with noisy targets (so the loss settles at a level that can be
    compared), 300 steps: the final loss within 1% of fp32 Adam's."""

    def train(make_optimizer) -> float:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        generator = torch.Generator().manual_seed(1)
        data = torch.randn(2048, 16, generator=generator)
        target = torch.sin(data[:, :4].sum(dim=1, keepdim=True)) + 0.3 * torch.randn(2048, 1, generator=generator)
        optimizer = make_optimizer(model.parameters())
        for _ in range(300):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(data), target)
            loss.backward()
            optimizer.step()
        return torch.nn.functional.mse_loss(model(data), target).item()

    fp32 = train(lambda ps: torch.optim.Adam(ps, lr=3e-3))
    bf16 = train(lambda ps: ds_ops.CPUAdam(ps, lr=3e-3, state_dtype=torch.bfloat16))
    assert fp32 > 0.05  # the noise floor: a level worth comparing, not a loss that vanishes
    assert abs(bf16 - fp32) <= 0.01 * fp32, (bf16, fp32)


def test_results_do_not_depend_on_the_thread_count():
    results = []
    for threads in (1, 2):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            p = _param(300001)
            opt = ds_ops.CPUAdam([p], lr=1e-2, state_dtype=torch.bfloat16)
            _run(opt, p, _grads(300001, 3, torch.float32))
            results.append((p.detach().clone(), opt.state[p]["exp_avg"].clone()))
        finally:
            torch.set_num_threads(previous)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("weight_decay, lr_decay, initial", [(0.0, 0.0, 0.0), (0.01, 0.1, 0.5)])
@pytest.mark.parametrize("n", SIZES)
def test_cpu_adagrad_matches_torch_adagrad(n, weight_decay, lr_decay, initial):
    ours, ref = _param(n), _param(n)
    grads = _grads(n, 20, torch.float32)
    opt = ds_ops.CPUAdagrad([ours], lr=1e-2, lr_decay=lr_decay, weight_decay=weight_decay,
                            initial_accumulator_value=initial)
    ref_opt = torch.optim.Adagrad([ref], lr=1e-2, lr_decay=lr_decay, weight_decay=weight_decay,
                                  initial_accumulator_value=initial)
    _run(opt, ours, grads)
    _run(ref_opt, ref, grads)
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[ours]["sum"], ref_opt.state[ref]["sum"], rtol=1e-5, atol=1e-6)


def _lion_reference(p: torch.Tensor, grads, lr, betas, weight_decay):
    """Lion as written in the paper's Algorithm 2 (Chen et al. 2023), in float64. Also returns the
    elements whose update direction was within rounding of 0 at some step (their sign is a tie)."""
    p, m = p.detach().clone().double(), torch.zeros_like(p, dtype=torch.float64)
    beta1, beta2 = betas
    tie = torch.zeros_like(p, dtype=torch.bool)
    for g in grads:
        g = g.double()
        direction = beta1 * m + (1 - beta1) * g
        tie |= direction.abs() < 1e-6 * (m.abs() + g.abs())
        p = p * (1 - lr * weight_decay) - lr * direction.sign()
        m = beta2 * m + (1 - beta2) * g
    return p.float(), m.float(), tie


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_cpu_lion_matches_the_paper(n, weight_decay, grad_dtype):
    p = _param(n)
    start = p.detach().clone()
    grads = _grads(n, 20, grad_dtype)
    opt = ds_ops.CPULion([p], lr=1e-3, betas=(0.9, 0.99), weight_decay=weight_decay)
    _run(opt, p, grads)
    ref_p, ref_m, tie = _lion_reference(start, grads, 1e-3, (0.9, 0.99), weight_decay)
    assert tie.sum() <= 200  # 0.02% at most: the comparison below covers the rest
    torch.testing.assert_close(p.detach()[~tie], ref_p[~tie], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[p]["exp_avg"], ref_m, rtol=1e-5, atol=1e-6)


def _lamb_reference(params, grads_per_step, lr, betas, eps, weight_decay=0.0, bias_correction=True,
                    eps_inside_sqrt=False, max_coeff=10.0, min_coeff=0.01, max_grad_norm=0.0):
    """LAMB from the paper's Algorithm 2 (You et al. 2020) with DeepSpeed's clamped trust ratio."""
    params = [p.detach().clone().double() for p in params]
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    beta1, beta2 = betas
    ratios = []
    for t, grads in enumerate(grads_per_step, start=1):
        grads = [g.double() for g in grads]
        if max_grad_norm > 0:
            total = torch.sqrt(sum((g * g).sum() for g in grads))
            grads = [g * min(1.0, max_grad_norm / (float(total) + 1e-6)) for g in grads]
        ratios = []
        for p, m, v, g in zip(params, ms, vs, grads, strict=True):
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            v.mul_(beta2).add_(g * g, alpha=1 - beta2)
            m_hat = m / (1 - beta1**t) if bias_correction else m
            v_hat = v / (1 - beta2**t) if bias_correction else v
            denom = (v_hat + eps).sqrt() if eps_inside_sqrt else v_hat.sqrt() + eps
            u = m_hat / denom + weight_decay * p
            p_norm, u_norm = float(p.norm()), float(u.norm())
            r = p_norm / u_norm if p_norm > 0 and u_norm > 0 else 1.0
            r = min(max_coeff, max(min_coeff, r))
            ratios.append(r)
            p.sub_(lr * r * u)
    return [p.float() for p in params], ratios


@pytest.mark.parametrize("options", [
    {},
    {"weight_decay": 0.01},
    {"bias_correction": False, "eps_inside_sqrt": True},
    {"max_coeff": 0.5},  # forces the upper clamp
    {"min_coeff": 50.0, "max_coeff": 60.0},  # forces the lower clamp
    {"max_grad_norm": 1.0},
])
def test_fused_lamb_matches_the_paper(options):
    shapes = [(1000003,), (7,), (33, 3)]
    g = torch.Generator().manual_seed(5)
    params = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    start = [p.detach().clone() for p in params]
    steps = [[torch.randn(s, generator=g) for s in shapes] for _ in range(5)]
    opt = ds_ops.FusedLamb(params, lr=1e-2, **options)
    for grads in steps:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad.clone()
        opt.step()
    expected, ratios = _lamb_reference(start, steps, 1e-2, (0.9, 0.999), 1e-8, **options)
    atol = 1e-5 * max(1.0, options.get("min_coeff", 0.0))  # float32 rounding of steps that large
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=atol)
    assert opt.lamb_coeffs == pytest.approx(ratios, rel=1e-4)


def test_fused_lamb_trust_ratio_is_one_for_a_zero_parameter():
    p = torch.zeros(100, requires_grad=True)
    p.grad = torch.ones(100)
    opt = ds_ops.FusedLamb([p], lr=0.1)
    opt.step()
    assert opt.lamb_coeffs == [1.0]
    torch.testing.assert_close(p.detach(), torch.full((100,), -0.1), rtol=1e-5, atol=1e-6)


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, message", [
    (lambda p: ds_ops.CPUAdam([p], amsgrad=True), "does not support amsgrad"),
    (lambda p: ds_ops.FusedAdam([p], amsgrad=True), "does not support amsgrad"),
    (lambda p: ds_ops.FusedLamb([p], amsgrad=True), "does not support amsgrad"),
    (lambda p: ds_ops.CPUAdam([p], lr=-1.0), "lr must be >= 0, got -1.0"),
    (lambda p: ds_ops.CPUAdam([p], betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\)"),
    (lambda p: ds_ops.CPUAdam([p], eps=-1e-8), "eps must be >= 0"),
    (lambda p: ds_ops.CPULion([p], weight_decay=-0.1), "weight_decay must be >= 0"),
    (lambda p: ds_ops.CPUAdam([p], state_dtype=torch.float16), "state_dtype must be torch.float32 or torch.bfloat16"),
    (lambda p: ds_ops.FusedLamb([p], min_coeff=2.0, max_coeff=1.0), "need 0 <= min_coeff <= max_coeff"),
    (lambda p: ds_ops.CPUAdagrad([p], lr_decay=-1.0), "lr_decay and initial_accumulator_value must be >= 0"),
])
def test_bad_hyperparameters_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make(_param(4))


@pytest.mark.parametrize("optimizer", [ds_ops.CPUAdam, ds_ops.CPUAdagrad, ds_ops.CPULion])
def test_bad_tensors_are_rejected_clearly(optimizer):
    strided = torch.randn(8, 8).t().requires_grad_()
    strided.grad = torch.randn(8, 8).t()
    with pytest.raises(ValueError, match=r"parameter of shape \(8, 8\) is not contiguous"):
        optimizer([strided]).step()
    if optimizer is not ds_ops.CPUAdagrad:  # they update 16-bit parameters too; not float64 ones
        double = torch.randn(8, dtype=torch.float64, requires_grad=True)
        double.grad = torch.randn(8, dtype=torch.float64)
        with pytest.raises(ValueError, match=r"is torch\.float64; \w+ updates float32, bfloat16 or float16"):
            optimizer([double]).step()
    else:  # the message says what to do, not only what is wrong
        half = torch.randn(8, dtype=torch.float16, requires_grad=True)
        half.grad = torch.randn(8, dtype=torch.float16)
        with pytest.raises(ValueError, match=r"is torch\.float16; \w+ updates float32 parameters only\. Keep float32 "
                                             r"master weights .* CPUAdam and CPULion also update bfloat16/float16"):
            optimizer([half]).step()
    meta = torch.empty(8, device="meta", requires_grad=True)
    meta.grad = torch.empty(8, device="meta")
    with pytest.raises(ValueError, match="is on meta; this optimizer updates CPU tensors"):
        optimizer([meta]).step()
    p = _param(8)
    p.grad = torch.randn(16)[::2]
    with pytest.raises(ValueError, match=r"gradient .* not contiguous"):
        optimizer([p]).step()


def test_bad_half_copies_are_rejected():
    p = _param(8)
    p.grad = torch.randn(8)
    opt = ds_ops.CPUAdam([p])
    with pytest.raises(ValueError, match=r"must be a contiguous CPU float16/bfloat16 tensor, got torch\.float32"):
        opt.step(fp16_param_groups=[[torch.empty(8)]])
    with pytest.raises(ValueError, match="the 16-bit copy has 4 elements, its parameter 8"):
        opt.step(fp16_param_groups=[[torch.empty(4, dtype=torch.float16)]])
    with pytest.raises(ValueError, match="fp16_param_groups has 2 groups, the optimizer 1"):
        opt.step(fp16_param_groups=[[], []])


def test_bad_input_leaves_the_optimizer_state_untouched():
    good, bad = _param(16), torch.randn(8, 8).t().requires_grad_()
    good.grad, bad.grad = torch.randn(16), torch.randn(8, 8).t()
    for optimizer in (ds_ops.CPUAdam([good, bad]), ds_ops.CPULion([good, bad])):
        with pytest.raises(ValueError, match="not contiguous"):
            optimizer.step()
        assert optimizer.state[good] == {}  # no step counted, no state made for the good parameter


# ---- CPUAdagrad: DeepSpeed's argument order, sparse gradients ---------------------------------------

def test_cpu_adagrad_takes_deepspeeds_positional_order():
    """DeepSpeedCPUAdagrad(model_params, lr, eps, weight_decay, amsgrad, fp32_optimizer_states)."""
    p = _param(8)
    opt = ds_ops.CPUAdagrad([p], 0.1, 1e-6, 0.01, False, True)
    group = opt.param_groups[0]
    assert (group["lr"], group["eps"], group["weight_decay"], group["lr_decay"]) == (0.1, 1e-6, 0.01, 0.0)
    assert opt.fp32_optimizer_states is True
    with pytest.raises(ValueError, match="amsgrad=True has no meaning for Adagrad"):
        ds_ops.CPUAdagrad([p], 0.1, 1e-6, 0.0, True)
    with pytest.raises(TypeError):
        ds_ops.CPUAdagrad([p], 0.1, 1e-6, 0.0, False, True, 0.5)  # lr_decay is keyword-only now


def _embedding_batches(rows: int, steps: int, seed: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, rows, (24,), generator=g) for _ in range(steps)]  # repeats included


@pytest.mark.parametrize("lr_decay, initial, grad_dtype", [(0.0, 0.0, torch.float32), (0.1, 0.5, torch.float32),
                                                           (0.0, 0.1, torch.bfloat16)])
def test_cpu_adagrad_sparse_gradients_match_torch_adagrad(lr_decay, initial, grad_dtype):
    """An embedding with sparse=True and a dense layer in one optimizer, against torch's Adagrad."""
    torch.manual_seed(0)
    ours = torch.nn.ModuleDict({"emb": torch.nn.Embedding(50, 12, sparse=True), "out": torch.nn.Linear(12, 3)})
    theirs = copy.deepcopy(ours)
    opt = ds_ops.CPUAdagrad(ours.parameters(), lr=0.1, lr_decay=lr_decay, initial_accumulator_value=initial)
    ref = torch.optim.Adagrad(theirs.parameters(), lr=0.1, lr_decay=lr_decay, initial_accumulator_value=initial)
    untouched = set(range(50))
    for ids in _embedding_batches(50, 6):
        untouched -= set(ids.tolist())
        for model, optimizer in ((ours, opt), (theirs, ref)):
            optimizer.zero_grad()
            model["out"](model["emb"](ids)).square().sum().backward()
            if grad_dtype != torch.float32:
                weight = model["emb"].weight
                weight.grad_dtype = None
                weight.grad = weight.grad.coalesce().to(grad_dtype)
                if optimizer is ref:
                    weight.grad = weight.grad.float()  # what our kernel reads
            optimizer.step()
    assert ours["emb"].weight.grad.is_sparse and untouched  # some rows were never touched
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(opt.state[a]["sum"], ref.state[b]["sum"], rtol=1e-5, atol=1e-6, msg=name)
    rows = sorted(untouched)
    assert torch.equal(opt.state[ours["emb"].weight]["sum"][rows], torch.full((len(rows), 12), initial))


def test_cpu_adagrad_sparse_gradient_with_two_sparse_dims():
    p = torch.randn(6, 5, 4, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    indices = torch.tensor([[0, 5, 2, 0], [1, 4, 3, 1]])  # (0, 1) twice: coalesced into one row
    values = torch.randn(4, 4)
    opt, ref = ds_ops.CPUAdagrad([p], lr=0.05), torch.optim.Adagrad([q], lr=0.05)
    for _ in range(3):
        p.grad = torch.sparse_coo_tensor(indices, values, (6, 5, 4))
        q.grad = p.grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_cpu_adagrad_sparse_gradient_refusals_say_why():
    p = torch.randn(10, 4, requires_grad=True)
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.randn(2, 4), (10, 4))
    with pytest.raises(ValueError, match=r"weight decay does not work with sparse gradients \(as in torch\.optim\.Adagrad\)"):
        ds_ops.CPUAdagrad([p], weight_decay=0.01).step()
    for optimizer in (ds_ops.CPUAdam, ds_ops.CPULion):
        with pytest.raises(ValueError, match=r"has a sparse gradient; \w+ takes dense gradients \(CPUAdagrad"):
            optimizer([p]).step()
