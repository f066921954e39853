"""Every native kernel with a SIMD path, at every SIMD level this CPU has, against torch's reference on
adversarial inputs: the kernels' contract (README, "Denormals") is checked where it can break.

Levels: the tests run on the ops this process loads (the native build users get, ``-march=native``),
then ``test_the_matrix_passes_at_every_simd_level_this_cpu_has`` runs them again in a process of its own
for each portable build (``DS_BUILD_SIMD=avx512|avx2|scalar``, built side by side in the op cache; an
extension module of one name loads only once per process). A level the CPU lacks, or one the native
build already is, is a skip that says so (``pytest -rs`` lists them); the run ends with a line naming
the levels it covered and what each counted.

Kernels: Adam with float32 states on its three call paths (the classes, ``adam_step`` unscaled, scaled with
and without its finite check) and with bf16 states, the finite check, the 16-bit copy-out, stochastic
rounding, Adagrad, Lion, LAMB, 1-bit pack/unpack, block-sparse attention (forward and backward), block quantization (int8
and int4: quantize, dequantize, the k-tensor sum and its requantization; bit for bit against the torch
reference, ``ds_ops._quantize_torch``).

Inputs (``KINDS``): ordinary values; zeros; gradients of 1e-20 (second moments subnormal: the PR-MoE
gate's first steps, where the AVX-512 Adam wrote nan); subnormal gradients; subnormal states;
gradients near overflow (their squares overflow unless taken in torch's order); inf and nan where the
contract lets them through. Sizes 0 to 2 * 16 + 1 (every tail of an AVX-512 vector) and 100 003
(several threads: 1, 2 and 3), buffers at unaligned offsets, several tensors per call.

Comparison (``assert_ieee_close``): nan exactly where the reference has nan, infinities equal, finite
values within ``atol + rtol * |ref|``. Parameters within 1e-6 (AVX-512's Newton-refined estimates of
sqrt and 1/x are good to about 2^-22); states within 1e-6 relative (and 1e-44 absolute: one ulp of
the subnormals' coarse spacing); bf16 states within one bf16 ulp (stochastic rounding).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ds_ops
from ds_ops import _quantize_torch, onebit
from ds_ops.op_builder import system
from ds_ops.op_builder.ops import CPUAdamBuilder
from ds_ops.sparse_attention import DenseSparsityConfig, SparseSelfAttention

PORTABLE_LEVELS = ("avx512", "avx2", "scalar")
_LEVEL_NAME = {"avx512": "AVX-512", "avx2": "AVX2", "scalar": "scalar"}
COVERED: dict[str, str] = {}  # level -> what its run reported (conftest.py prints it at the end)
CHILD = "DS_KERNEL_MATRIX_LEVEL"  # set in the run of one portable level
SIZES = [*range(34), 100_003]
THREADS = (1, 2, 3)
KINDS = ("normal", "zeros", "tiny", "subnormal_grads", "subnormal_states", "near_overflow", "nonfinite")


def levels_line() -> str:
    """What conftest.py prints at the end of the run."""
    return "SIMD levels covered by the kernel matrix: " + (
        "; ".join(f"{k}: {v}" for k, v in COVERED.items()) or "none")


@pytest.fixture(scope="module")
def level() -> str:
    """The SIMD level of the ops this process loads: the native build, or DS_BUILD_SIMD's (a module of
    one name loads once per process, so each portable level runs in a process of its own, below)."""
    if system.compiler() is None:
        pytest.skip("no C++ compiler: the kernels cannot be built")
    built = CPUAdamBuilder().load().simd_level()
    choice = os.environ.get("DS_BUILD_SIMD", "native")
    if choice != "native" and built != _LEVEL_NAME.get(choice):
        pytest.fail(f"DS_BUILD_SIMD={choice} but the loaded cpu_adam is {built} (a prebuilt op?)")
    COVERED.setdefault(choice, built)
    return built


@pytest.mark.parametrize("portable", PORTABLE_LEVELS)
def test_the_matrix_passes_at_every_simd_level_this_cpu_has(portable, tmp_path):
    """This file's tests again, in a process whose ops are built with DS_BUILD_SIMD=<level>, for every
    portable level the CPU runs and the native build is not."""
    if os.environ.get(CHILD):
        pytest.skip(f"this run is the {os.environ[CHILD]} level's own")
    model, flags = system.cpu()
    if not system.cpu_runs(portable):
        missing = [f for f in system.LEVEL_FEATURES[portable] if f not in flags]
        pytest.skip(f"SIMD level {portable}: this CPU ({model}) lacks {', '.join(missing)}")
    if system.compiler() is None:
        pytest.skip("no C++ compiler: the kernels cannot be built")
    env = {k: v for k, v in os.environ.items() if k != "DS_BUILD_SIMD"}
    native = CPUAdamBuilder().simd_level() if "DS_BUILD_SIMD" not in os.environ else None
    if native == _LEVEL_NAME[portable]:
        pytest.skip(f"SIMD level {portable}: the native build is {native}, covered by this run")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__],
                            capture_output=True, text=True, timeout=1200, cwd=Path(__file__).parent,
                            env={**env, "DS_BUILD_SIMD": portable, CHILD: portable})
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-3000:]
    summary = next(line for line in reversed(result.stdout.splitlines()) if " passed" in line)
    COVERED[portable] = f"{_LEVEL_NAME[portable]} ({summary.strip('= ')})"


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# ---- inputs ---------------------------------------------------------------------------------------------
def unaligned(values: torch.Tensor, offset: int) -> torch.Tensor:
    """``values`` copied into a buffer that starts ``offset`` floats past an aligned one."""
    base = torch.empty(values.numel() + offset, dtype=values.dtype)
    out = base[offset:]
    out.copy_(values)
    return out


def inputs(kind: str, n: int, seed: int) -> dict[str, torch.Tensor]:
    """p, g, m, v (float32) of one adversarial kind."""
    gen = torch.Generator().manual_seed(seed)

    def randn(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(n, generator=gen) * scale

    p = randn()
    m, v = torch.zeros(n), torch.zeros(n)
    if kind == "normal":
        g, m, v = randn(), randn(0.1), torch.rand(n, generator=gen) * 0.01
    elif kind == "zeros":
        g = torch.zeros(n)
    elif kind == "tiny":
        g = randn(1e-20)
    elif kind == "subnormal_grads":
        g = randn(1e-39)
    elif kind == "subnormal_states":
        g, m, v = randn(1e-21), randn(1e-40), torch.rand(n, generator=gen) * 1e-40
    elif kind == "near_overflow":
        g, v = randn(1e19), torch.rand(n, generator=gen) * 3e38
        p = randn(1e37)
    elif kind == "nonfinite":
        g = randn()
        for i, value in zip(range(0, n, 7), (math.inf, -math.inf, math.nan) * n, strict=False):
            g[i] = value
    else:
        raise ValueError(kind)
    return {"p": p, "g": g, "m": m, "v": v}


def assert_ieee_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float, what: str,
                      magnitude: torch.Tensor | None = None) -> None:
    """``magnitude``: what rtol is relative to, where not |expected| (a sum whose terms cancel)."""
    actual, expected = actual.float(), expected.float()
    nan_a, nan_e = actual.isnan(), expected.isnan()
    assert torch.equal(nan_a, nan_e), f"{what}: nan at {nan_a.nonzero().flatten()[:8].tolist()}, reference at " \
                                      f"{nan_e.nonzero().flatten()[:8].tolist()}"
    inf_a, inf_e = actual.isinf(), expected.isinf()
    assert torch.equal(inf_a, inf_e) and torch.equal(actual[inf_a], expected[inf_e]), \
        f"{what}: infinities differ at {(inf_a ^ inf_e).nonzero().flatten()[:8].tolist()}"
    finite = ~(nan_e | inf_e)
    error = (actual[finite] - expected[finite]).abs()
    bound = atol + rtol * (expected if magnitude is None else magnitude.float())[finite].abs()
    bad = (error > bound).nonzero().flatten()
    assert bad.numel() == 0, (f"{what}: {bad.numel()} of {int(finite.sum())} differ, first at "
                              f"{bad[0].item()}: {actual[finite][bad[0]].item()!r} vs "
                              f"{expected[finite][bad[0]].item()!r}")


def step_side_by_side(make_ours, make_reference, kind: str, seed: int, steps: int, check, what: str) -> None:
    """An optimizer of ours and torch's on the same inputs of every size (ours at unaligned offsets, all in
    one call), ``steps`` steps on 1, 2 and 3 threads; ``check(ours, theirs, opt, ref, what)`` per tensor."""
    for threads in THREADS:
        torch.set_num_threads(threads)
        xs = [inputs(kind, n, seed=n + seed) for n in SIZES]
        ours = [unaligned(x["p"], n % 3).requires_grad_() for x, n in zip(xs, SIZES, strict=True)]
        theirs = [x["p"].clone().requires_grad_() for x in xs]
        opt, ref = make_ours(ours), make_reference(theirs)
        for _ in range(steps):
            for a, b, x in zip(ours, theirs, xs, strict=True):
                a.grad, b.grad = x["g"].clone(), x["g"].clone()
            opt.step()
            ref.step()
        for a, b, n in zip(ours, theirs, SIZES, strict=True):
            check(a, b, opt, ref, f"{what} n={n} threads={threads}")


def cases(kind: str):
    """(n, threads, offset) of a test: every size on one thread, the large one on 1-3 threads."""
    for n in SIZES:
        for threads in (THREADS if n > 1000 else (1,)):
            yield n, threads, (n + threads) % 4


# ---- Adam: three call paths, fp32 states ---------------------------------------------------------------
P_TOL, S_TOL, S_ATOL = 1e-6, 1e-6, 1e-44
HYPER = {"lr": 1e-3, "betas": (0.8, 0.999), "eps": 1e-8, "weight_decay": 3e-7}


def torch_adam(x: dict, step: int, adamw: bool, grad_scale: float = 1.0):
    """torch.optim.AdamW / Adam (single-tensor path) from the given states; returns p, m, v."""
    p = x["p"].clone().requires_grad_()
    p.grad = x["g"].clone() / grad_scale if grad_scale != 1.0 else x["g"].clone()
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([p], foreach=False, **HYPER)
    opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": x["m"].clone(), "exp_avg_sq": x["v"].clone()}
    opt.step()
    return p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", ["adam_step", "adam_step scaled and checked", "adam_step scaled unchecked"])
def test_adam_step_matches_torch(level, kind, path):
    adamw = kind != "normal" or path == "adam_step"  # L2 mode once
    scale = 1.0 if path == "adam_step" else 1024.0
    for n, threads, offset in cases(kind):
        torch.set_num_threads(threads)
        x = inputs(kind, n, seed=n)
        if scale != 1.0:
            x["g"] = x["g"] * scale  # what the kernel unscales; the reference divides it back
        p, g, m, v = (unaligned(x[k], offset) for k in "pgmv")
        found = ds_ops.adam_step(p, g, m, v, 3, HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                                 weight_decay=HYPER["weight_decay"], adamw_mode=adamw, grad_scale=scale,
                                 check_finite=path == "adam_step scaled and checked")
        nonfinite = not bool(torch.isfinite(x["g"]).all())
        assert found == nonfinite, (n, found)  # checked: nothing written; unchecked: written, and said
        if found and path == "adam_step scaled and checked":  # skipped: nothing written
            for k, t in zip("pmv", (p, m, v), strict=True):
                assert torch.equal(t, x[k]), (k, n)
            continue
        ep, em, ev = torch_adam(x, 3, adamw, grad_scale=scale)
        what = f"{level} {kind} n={n} threads={threads} offset={offset}"
        assert_ieee_close(p, ep, P_TOL, P_TOL, f"params, {what}")
        assert_ieee_close(m, em, S_TOL, S_ATOL, f"exp_avg, {what}")
        assert_ieee_close(v, ev, S_TOL, S_ATOL, f"exp_avg_sq, {what}")


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "subnormal_states"])  # the classes start at zero
@pytest.mark.parametrize("optimizer", ["CPUAdam", "FusedAdam"])
def test_adam_classes_match_torch_adamw(level, kind, optimizer):
    """Several tensors (every size) in one call, two steps: the second starts from the first's states."""
    def check(ours, theirs, opt, ref, what):
        assert_ieee_close(ours.detach(), theirs.detach(), P_TOL, P_TOL, f"params, {what}")
        assert_ieee_close(opt.state[ours]["exp_avg_sq"], ref.state[theirs]["exp_avg_sq"], S_TOL, S_ATOL,
                          f"exp_avg_sq, {what}")

    extra = {"adamw_mode": True} if optimizer == "CPUAdam" else {}
    step_side_by_side(lambda ps: getattr(ds_ops, optimizer)(ps, **HYPER, **extra),
                      lambda ps: torch.optim.AdamW(ps, foreach=False, **HYPER), kind, seed=7, steps=2, check=check,
                      what=f"{level} {optimizer} {kind}")


def test_the_issue_reproduction_is_finite_and_equals_adamw(level):
    """Issue 41's reproduction: gradients of 1e-20, one CPUAdam step (nan on AVX-512 before the fix)."""
    w = torch.nn.Parameter(torch.randn(4096, generator=torch.Generator().manual_seed(0)))
    w.grad = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 1e-20
    expected = torch.nn.Parameter(w.detach().clone())
    expected.grad = w.grad.clone()
    ds_ops.CPUAdam([w], lr=1e-3, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7).step()
    torch.optim.AdamW([expected], lr=1e-3, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7).step()
    assert not w.isnan().any()
    torch.testing.assert_close(w.detach(), expected.detach(), rtol=0, atol=1e-6)


def test_flush_modes_of_the_calling_thread_do_not_change_results(level):
    """The denormal policy holds whatever MXCSR says: torch.set_flush_denormal(True) sets FTZ/DAZ in
    this thread, and a 1-thread step runs here; the kernel keeps subnormals all the same."""
    x = inputs("subnormal_states", 4099, seed=3)
    results = []
    for flush in (False, True):
        if flush and not torch.set_flush_denormal(True):
            pytest.skip("this CPU cannot flush denormals (no FTZ/DAZ)")
        try:
            torch.set_num_threads(1)
            p, g, m, v = (x[k].clone() for k in "pgmv")
            ds_ops.adam_step(p, g, m, v, 3, 1e-3, check_finite=False)
            results.append((p, m, v))
        finally:
            torch.set_flush_denormal(False)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert bool(((results[1][2] != 0) & (results[1][2].abs() < 1.1754944e-38)).any())  # subnormals kept


# ---- Adam with bf16 states -----------------------------------------------------------------------------
BF16_REL = 2.0**-7  # one ulp of bfloat16: where stochastic rounding may put a state
BF16_ATOL = 2.0**-133  # one ulp of bfloat16's subnormals


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "subnormal_states"])
def test_adam_bf16_states_match_torch_within_a_bf16_ulp(level, kind):
    """One step from zero states: the update reads the float32 moments before they are rounded, so the
    parameters meet AdamW within 2e-6 (the 12-14-bit estimates of sqrt and 1/x); the states are one of
    the two bf16 neighbours of torch's."""
    def check(ours, theirs, opt, ref, what):
        assert_ieee_close(ours.detach(), theirs.detach(), 2e-6, 2e-6, f"params, {what}")
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt.state[ours][key].dtype == torch.bfloat16
            assert_ieee_close(opt.state[ours][key], ref.state[theirs][key], BF16_REL, BF16_ATOL, f"{key}, {what}")

    step_side_by_side(lambda ps: ds_ops.CPUAdam(ps, state_dtype=torch.bfloat16, **HYPER),
                      lambda ps: torch.optim.AdamW(ps, foreach=False, **HYPER), kind, seed=11, steps=1, check=check,
                      what=f"{level} bf16 states {kind}")


def test_stochastic_rounding_is_unbiased(level):
    """A bf16 state of one constant value, 2^20 times: the mean of the rounded states is the value."""
    n = 1 << 20
    value = 1.0 + 2.0**-9 + 2.0**-12  # between two bf16 numbers, 9/16 of the way up
    p = torch.zeros(n, requires_grad=True)
    p.grad = torch.full((n,), value / 0.5)  # exp_avg = (1 - 0.5) * g = value
    opt = ds_ops.CPUAdam([p], lr=0.0, betas=(0.5, 0.999), state_dtype=torch.bfloat16)
    opt.step()
    state = opt.state[p]["exp_avg"].float()
    low, high = 1.0, 1.0 + 2.0**-7
    assert bool(((state == low) | (state == high)).all())
    assert abs(state.double().mean().item() - value) < 4 * 2.0**-7 / math.sqrt(n)


# ---- the finite check and the 16-bit copy-out ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_finite_check_finds_every_inf_and_nan(level, dtype):
    """Every position of every tail, and a product that overflows only after unscaling."""
    for n in [1, *range(2, 34, 3), 100_003]:
        torch.set_num_threads(2 if n > 1000 else 1)
        g = unaligned(torch.randn(n).to(dtype), n % 3)
        assert not ds_ops.has_inf_or_nan(g)
        for i in ([*range(n)] if n < 40 else [0, 1, n // 2, n - 17, n - 1]):
            for bad in (math.inf, -math.inf, math.nan):
                saved = g[i].item()
                g[i] = bad
                assert ds_ops.has_inf_or_nan(g), (n, i, bad)
                g[i] = saved
        sub = unaligned(torch.full((n,), 1e-40 if dtype == torch.float32 else 1e-7).to(dtype), 1)
        assert not ds_ops.has_inf_or_nan(sub, grad_scale=1024.0)  # subnormals are finite
        big = torch.full((n,), torch.finfo(dtype).max, dtype=dtype)
        assert not ds_ops.has_inf_or_nan(big)
        assert ds_ops.has_inf_or_nan(big, grad_scale=0.25) == bool(  # torch's: unscale, then look
            (~torch.isfinite(big.float() * (1 / 0.25))).any())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_16_bit_copy_is_the_float32_result_rounded(level, dtype):
    """Values at the edges of the 16-bit formats (overflow, subnormals, ties, inf, nan): zero gradients
    leave each parameter as it is, and its copy must be torch's rounding of it, bit for bit."""
    edges = torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e5, -1e5, 6e-8, 3e-8, 2.9e-8, 6.1e-5, 1e-40,
                          3.3895e38, math.inf, -math.inf, math.nan, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11])
    for n in SIZES:
        torch.set_num_threads(2 if n > 1000 else 1)
        base = torch.randn(n) * 1e3
        base[: min(n, edges.numel())] = edges[: min(n, edges.numel())]
        p = unaligned(base, n % 3)
        g, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
        copy = unaligned(torch.zeros(n, dtype=dtype), 1)
        ds_ops.adam_step(p, g, m, v, 1, 1e-3, half_copy=copy, check_finite=False)
        expected = p.to(dtype)
        same = (copy.view(torch.int16) == expected.view(torch.int16)) | (copy.isnan() & expected.isnan())
        assert bool(same.all()), (level, n, p[~same][:4].tolist(), copy[~same][:4].tolist())


# ---- Adagrad, Lion, LAMB ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "subnormal_states"])
def test_adagrad_matches_torch(level, kind):
    def check(ours, theirs, opt, ref, what):
        assert_ieee_close(ours.detach(), theirs.detach(), P_TOL, P_TOL, what)

    step_side_by_side(lambda ps: ds_ops.CPUAdagrad(ps, lr=1e-2, eps=1e-10, weight_decay=1e-4),
                      lambda ps: torch.optim.Adagrad(ps, lr=1e-2, eps=1e-10, weight_decay=1e-4, foreach=False),
                      kind, seed=3, steps=2, check=check, what=f"{level} adagrad {kind}")


def lion_reference(p, g, m, lr, betas, weight_decay):
    """The paper's Lion in float32, the interpolation rounded once as the kernel's fused multiply-add
    (a sign is all it feeds, so a second rounding could flip a tiny one to zero)."""
    b1, b2 = betas
    direction = torch.sign((m.double() * b1 + g.double() * (1 - b1)).float())
    p = p * (1 - lr * weight_decay) - lr * direction
    return p, m * b2 + g * (1 - b2)


@pytest.mark.parametrize("kind", KINDS)
def test_lion_matches_the_paper(level, kind):
    for n, threads, offset in cases(kind):
        torch.set_num_threads(threads)
        x = inputs(kind, n, seed=n + 5)
        if kind == "near_overflow":
            x["m"] = x["v"]  # a momentum near the top of float32
        p = unaligned(x["p"], offset).requires_grad_()
        opt = ds_ops.CPULion([p], lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
        opt.state[p]["exp_avg"] = x["m"].clone()
        p.grad = x["g"].clone()
        opt.step()
        ep, em = lion_reference(x["p"], x["g"], x["m"], 1e-3, (0.9, 0.99), 0.1)
        what = f"{level} lion {kind} n={n} threads={threads}"
        assert_ieee_close(p.detach(), ep, P_TOL, P_TOL, f"params, {what}")
        terms = x["m"].abs() * 0.99 + x["g"].abs() * 0.01  # the kernel rounds once where torch rounds twice
        assert_ieee_close(opt.state[p]["exp_avg"], em, S_TOL, S_ATOL, f"exp_avg, {what}", magnitude=terms)


def lamb_reference(p, grads, lr, betas, eps, weight_decay, max_coeff=10.0, min_coeff=0.01):
    """LAMB (You et al. 2020, DeepSpeed's clamped trust ratio) in float64, one tensor."""
    p, beta1, beta2 = p.double(), *betas
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = m * beta1 + g * (1 - beta1)
        v = v * beta2 + g * g * (1 - beta2)
        u = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps) + weight_decay * p
        p_norm, u_norm = float(p.norm()), float(u.norm())
        r = min(max_coeff, max(min_coeff, p_norm / u_norm if p_norm > 0 and u_norm > 0 else 1.0))
        p = p - lr * r * u
    return p.float()


@pytest.mark.parametrize("kind", ["normal", "zeros", "tiny", "subnormal_grads"])
def test_lamb_matches_the_paper(level, kind):
    for threads in THREADS:
        torch.set_num_threads(threads)
        xs = [inputs(kind, n, seed=n + 9) for n in SIZES]
        ours = [unaligned(x["p"], 3).requires_grad_() for x in xs]
        opt = ds_ops.FusedLamb(ours, lr=1e-2, weight_decay=0.01)
        for _ in range(2):
            for a, x in zip(ours, xs, strict=True):
                a.grad = x["g"].clone()
            opt.step()
        for a, x, n in zip(ours, xs, SIZES, strict=True):
            expected = lamb_reference(x["p"], [x["g"], x["g"]], 1e-2, (0.9, 0.999), 1e-8, 0.01)
            assert_ieee_close(a.detach(), expected, 1e-5, 1e-5, f"{level} lamb {kind} n={n} threads={threads}")


# ---- 1-bit compression ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["normal", "zeros", "tiny", "subnormal_grads"])
def test_onebit_pack_and_unpack_match_the_reference(level, kind):
    """compress: the sign bits exactly and the scale (RMS) to float32's last bit; decompress: ±scale;
    chunk sizes with every tail of a vector of sign bytes, 1-3 threads."""
    for chunks, chunk in [(1, 8), (1, 136), (2, 264), (3, 520), (2, 50_008)]:
        for threads in (THREADS if chunk > 1000 else (1,)):
            n = chunks * chunk - 5
            x = inputs(kind, n, seed=chunk)["g"]
            if kind == "normal":
                x[::13] = -0.0  # -0.0 counts as >= 0
            state = torch.zeros(onebit.state_size(chunks, chunk))
            frames = torch.empty(chunks, onebit.frame_bytes(chunk), dtype=torch.uint8)
            onebit.compress(unaligned(x, 1), state, frames, num_threads=threads)
            work = torch.cat([x, torch.zeros(5)]).view(chunks, chunk)
            bits = (work >= 0).to(torch.uint8).view(chunks, -1, 8)
            signs = (bits << torch.arange(8, dtype=torch.uint8)).sum(dim=2, dtype=torch.uint8)
            assert torch.equal(frames[:, : chunk // 8], signs), (level, kind, chunks, chunk)
            scales = frames[:, -onebit.SCALE_BYTES:].reshape(-1).clone().view(torch.float32)
            expected = torch.tensor([math.sqrt(math.fsum(v * v for v in row.double().tolist()) / chunk)
                                     for row in work]).float()
            assert_ieee_close(scales, expected, 2.0**-23, 0.0, f"{level} onebit scales {kind} chunk={chunk}")
            out = torch.empty(n)
            onebit.decompress(frames, out, num_threads=threads)
            decoded = torch.where(work.view(-1)[:n] >= 0, 1.0, -1.0) * expected.repeat_interleave(chunk)[:n]
            assert_ieee_close(out, decoded, 2.0**-23, 0.0, f"{level} onebit decompress {kind} chunk={chunk}")


# ---- block-sparse attention ---------------------------------------------------------------------------------
ATTENTION_KINDS = ("normal", "huge_scores", "tiny", "masked_row")


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
@pytest.mark.parametrize("head_dim", [33, 40])  # tails of a vector in the head dimension
def test_sparse_attention_matches_sdpa(level, kind, head_dim):
    """SparseSelfAttention (dense layout, causal, key padding) against torch's SDPA, output and gradients:
    scores so large that most of e^x underflows, subnormal queries, keys and values (every score
    subnormal: a uniform softmax), and a batch row whose keys are all masked (0 where SDPA gives nan)."""
    shape, seq = (2, 2, 64, head_dim), 64
    for threads in THREADS:
        torch.set_num_threads(threads)
        g = torch.Generator().manual_seed(head_dim)
        q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
        mask = torch.ones(2, seq)
        mask[1, 50:] = 0
        if kind == "huge_scores":
            q = q * 40
        elif kind == "tiny":
            q, k, v = q * 1e-20, k * 1e-20, v * 1e-39
        elif kind == "masked_row":
            mask[0] = 0
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        module = SparseSelfAttention(DenseSparsityConfig(2), key_padding_mask_mode="mul", max_seq_length=seq)
        out = module(q, k, v, key_padding_mask=mask, causal=True)
        grad = torch.randn(shape, generator=g)
        out.backward(grad)
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        allowed = torch.ones(seq, seq, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]
        ref = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed)
        live = allowed.any(-1, keepdim=True).expand(shape)  # rows with a key to attend to
        ref = torch.where(live, ref, 0.0)
        ref.backward(grad)
        what = f"{level} sparse attention {kind} head_dim={head_dim} threads={threads}"
        # errors scale with the inputs: outputs of values of 1e-39 are that small; queries of 40x give
        # scores of a few hundred, whose rounding (sums of head_dim products, in another order than
        # SDPA's) moves the peaked probabilities by ~1e-3 relative: so the gradients' bounds
        huge = kind == "huge_scores"
        rtol = 5e-3 if huge else 1e-4
        atol = {"out": 5e-5 * (1e-39 if kind == "tiny" else 1.0), "dq": 5e-5, "dv": 5e-5 * (40 if huge else 1),
                "dk": 5e-5 * (40 if huge else 1)}
        for name, a, b in (("out", out, ref), ("dq", q.grad, qs.grad), ("dk", k.grad, ks.grad),
                           ("dv", v.grad, vs.grad)):
            b = torch.where(b.isnan(), 0.0, b)  # SDPA's nan gradients of fully masked rows: ours are 0
            assert_ieee_close(a, b, rtol, atol[name], f"{name}, {what}")


# ---- block quantization ---------------------------------------------------------------------------------
QUANT_KINDS = ("normal", "zeros", "ties", "subnormal", "tiny_scale", "near_overflow", "nonfinite")
QUANT_GROUPS = {8: (1, 7, 16, 33, 2048), 4: (2, 6, 16, 34, 2048)}  # odd, below, at and past a vector


def quant_inputs(kind: str, n: int, seed: int) -> torch.Tensor:
    """float32 inputs of one adversarial kind for the quantization kernels."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    if kind == "zeros":
        x = torch.zeros(n)
        x[1::3] = -0.0
    elif kind == "ties":  # x / scale lands on k + 1/2 (absmax 127 or 7: the scale is 1)
        x = (torch.randint(-20, 20, (n,), generator=gen).float() + 0.5).clamp(-6.5, 6.5)
        x[::5] = 7.0
    elif kind == "subnormal":
        x = x * 1e-39
    elif kind == "tiny_scale":  # absmax just above and below where absmax / 127 underflows
        x = x * 2.0**-140
        x[::9] = 1e-44
    elif kind == "near_overflow":
        x = x * 1e38
        x[::4] = torch.finfo(torch.float32).max
    elif kind == "nonfinite":
        for i, value in zip(range(0, n, 11), (math.inf, -math.inf, math.nan) * n, strict=False):
            x[i] = value
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, nan where the other has nan (the kernels' nan and torch's are both quiet nans)."""
    a, b = a.float(), b.float()
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()].view(torch.int32),
                                                             b[~b.isnan()].view(torch.int32))


@pytest.mark.parametrize("kind", QUANT_KINDS)
@pytest.mark.parametrize("bits", [8, 4])
def test_block_quantization_is_the_reference_bit_for_bit(level, kind, bits):
    """quantize and dequantize (float32, float16, bfloat16 in and out) at every size to 2 vectors + 1 and
    100 003 elements (1-3 threads), groups odd (int8), below, at and past a vector; unaligned inputs."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for group in QUANT_GROUPS[bits]:
            for n, threads, offset in cases(kind):
                if n > 1000 and group < 16:
                    continue
                torch.set_num_threads(threads)
                x = unaligned(quant_inputs(kind, n, seed=n + group).to(dtype), offset)
                q, scales = ds_ops.quantize_blockwise(x, group, bits)
                rq, rscales = _quantize_torch.quantize(x, group, bits)
                what = f"{level} {kind} int{bits} {dtype} group={group} n={n} threads={threads}"
                assert torch.equal(q, rq), f"q differs, {what}: {(q != rq).nonzero().flatten()[:8].tolist()}"
                assert same_bits(scales, rscales), f"scales differ, {what}"
                y = ds_ops.dequantize_blockwise(q, scales, n, group, bits, dtype)
                assert same_bits(y, _quantize_torch.dequantize(rq, rscales, n, group, bits, dtype)), \
                    f"dequantized values differ, {what}"


@pytest.mark.parametrize("kind", ["normal", "ties", "subnormal", "near_overflow", "nonfinite"])
@pytest.mark.parametrize("bits", [8, 4])
def test_block_quantized_sums_are_the_reference_bit_for_bit(level, kind, bits):
    """The k-tensor sum (k = 1, 2, 3) into each float dtype, and requantized into int8 and int4: sums of
    huge values overflow to inf (their group then nan), nan propagates."""
    for k in (1, 2, 3):
        for group in QUANT_GROUPS[bits][1:]:
            for n, threads, _offset in cases(kind):
                if n % 3 or (n > 1000 and group < 16):
                    continue
                torch.set_num_threads(threads)
                parts = [_quantize_torch.quantize(quant_inputs(kind, n, seed=n + t), group, bits) for t in range(k)]
                q, scales = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
                what = f"{level} {kind} int{bits} k={k} group={group} n={n} threads={threads}"
                for dtype in (torch.float32, torch.bfloat16, torch.float16):
                    total = ds_ops.dequantize_sum_blockwise(q, scales, n, group, bits, dtype)
                    assert same_bits(total, _quantize_torch.dequantize_sum(q, scales, n, group, bits).to(dtype)), \
                        f"sum into {dtype} differs, {what}"
                for out_bits in ((8, 4) if group % 2 == 0 else (8,)):
                    rq, rs = ds_ops.requantize_sum_blockwise(q, scales, n, group, bits, out_bits)
                    eq, es = _quantize_torch.quantize(_quantize_torch.dequantize_sum(q, scales, n, group, bits),
                                                      group, out_bits)
                    assert torch.equal(rq, eq) and same_bits(rs, es), f"requantized int{out_bits} differs, {what}"
