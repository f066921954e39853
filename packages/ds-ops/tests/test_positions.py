"""An element's update does not depend on where the span it is stepped in ends.

ZeRO steps the same partition whole (CPU offload), in ``sub_group_size`` chunks (NVMe offload) or
cut between threads, and promises the same bytes either way. The kernels step vectors of 8 or 16
lanes; the elements past the last whole vector of a span (its tail) used to go through scalar code,
whose sqrt and division are exact where the vector code uses hardware estimates (AVX-512's
rsqrt14/rcp14 for float32 states, AVX2's and AVX-512's for bfloat16 states). So an element got
different bits depending on the length of its tensor or chunk: on an AVX-512 CPU NVMe offload
(chunks of 3000 = 187 x 16 + 8) no longer matched CPU offload. Here each element is stepped as part
of tensors of many lengths (its position in a tail or in a whole vector, below and above the
two-thread size, where a thread's range ends mid-tensor) and must come out bit for bit the same.
The file runs against whatever build this process loads; test_builder runs it against the other
SIMD builds the CPU can run.
"""

from __future__ import annotations

import pytest
import torch

import ds_ops

SMALL = 80  # lengths 1..SMALL: every tail length of 8 and 16 lanes, several times over
LARGE = 40_000  # above the kernels' two-thread size (1 << 15): a thread's range ends mid-tensor
STEPS = 3


def _lengths() -> list[int]:
    return [*range(1, SMALL + 1), 1 << 15, (1 << 15) + 13, LARGE - 21, LARGE - 8, LARGE - 1]


def _data(n: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    params = torch.randn(n, generator=g).to(dtype)
    grads = [torch.randn(n, generator=g).to(dtype) for _ in range(STEPS)]
    grads[1][::97] = 0.0  # exact zeros: v = 0 lanes, sqrt(0) and eps alone in the denominator
    return params, grads


def _assert_prefixes_equal(run, dtype=torch.float32):
    """``run(params, grads) -> tensors`` steps a fresh copy of the first n elements; each prefix's
    tensors must equal the first n elements of the whole run's."""
    params, grads = _data(LARGE, dtype)
    whole = run(params.clone(), grads)
    for n in _lengths():
        part = run(params[:n].clone(), [g[:n] for g in grads])
        for name, a, b in zip(("params", "state 1", "state 2", "copy"), part, whole, strict=False):
            differ = (a.view(torch.int16 if a.element_size() == 2 else torch.int32)
                      != b[:n].view(torch.int16 if b.element_size() == 2 else torch.int32)).nonzero()
            assert differ.numel() == 0, (f"length {n}: {differ.numel()} elements of {name} differ from the same "
                                         f"elements stepped in a tensor of {LARGE}, first at {differ[0].item()} "
                                         f"(SIMD {ds_ops.op_builder.CPUAdamBuilder().load().simd_level()})")


ADAM_CASES = {  # (parameter dtype, state dtype, 16-bit copy dtype, grad_scale)
    "float32": (torch.float32, torch.float32, None, 1.0),
    "float32, loss scale": (torch.float32, torch.float32, None, 1024.0),
    "float32, bfloat16 states": (torch.float32, torch.bfloat16, None, 1.0),
    "float32, float16 copy": (torch.float32, torch.float32, torch.float16, 1.0),
    "float32, bfloat16 copy, bfloat16 states": (torch.float32, torch.bfloat16, torch.bfloat16, 1.0),
    "bfloat16": (torch.bfloat16, torch.float32, None, 1.0),
    "float16, bfloat16 states": (torch.float16, torch.bfloat16, None, 1.0),
}


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_adam_steps_an_element_the_same_wherever_its_span_ends(case, adamw):
    param_dtype, state_dtype, copy_dtype, scale = ADAM_CASES[case]

    def run(p, grads):
        m, v = torch.zeros_like(p, dtype=state_dtype), torch.zeros_like(p, dtype=state_dtype)
        copy = None if copy_dtype is None else torch.empty_like(p, dtype=copy_dtype)
        for step, g in enumerate(grads, start=1):
            # lr 1: the update is as large as the parameters, so a last-bit difference in it shows
            ds_ops.adam_step(p, g * scale, m, v, step, 1.0, weight_decay=0.1, adamw_mode=adamw, grad_scale=scale,
                             half_copy=copy, check_finite=False, seed=step)
        return (p, m, v) if copy is None else (p, m, v, copy)

    _assert_prefixes_equal(run, param_dtype)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("optimizer", ["CPUAdagrad", "CPULion", "CPUAdam"])
def test_the_optimizer_classes_step_an_element_the_same_wherever_its_tensor_ends(optimizer, state_dtype):
    def run(p, grads):
        p = torch.nn.Parameter(p)
        kwargs = {"lr": 1.0, "weight_decay": 0.1, "state_dtype": state_dtype}
        opt = getattr(ds_ops, optimizer)([p], **kwargs)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        return (p.detach(), *(t for t in opt.state[p].values() if torch.is_tensor(t) and t.numel() > 1))

    _assert_prefixes_equal(run)
