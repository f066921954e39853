"""CPUAdam (the optimizer of ZeRO-Offload), FusedAdam, and ``adam_step``, the functional step they
stand on.

Every update is one call of the ``cpu_adam`` kernel: a single vectorised, multi-threaded pass over
memory that reads p, g, m, v and writes p, m, v back (and, when asked, a float16/bfloat16 copy of
p in the same pass). State layout and formulas are those of ``torch.optim.Adam`` / ``AdamW``, so a
checkpoint moves between them. ``state_dtype=torch.bfloat16`` keeps ``exp_avg``/``exp_avg_sq`` in
bfloat16 with stochastic rounding: 20 instead of 28 bytes per parameter per step and half the
optimizer-state memory. ``adam_step`` does the same on buffers the caller owns (ZeRO's flat
partitions, which it may swap to NVMe), with the loss-scale division fused into the pass.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections import defaultdict

import torch

from . import _adam_device
from . import _adam_subgroup as subgroups
from . import _optimizer as common
from .op_builder import CPUAdamBuilder

logger = logging.getLogger(__name__)

_STATE_CODES = {torch.float32: 0, torch.bfloat16: 2}


def adam_step(params, grads, exp_avg, exp_avg_sq, step: int, lr: float, *, betas=(0.9, 0.999), eps: float = 1e-8,
              weight_decay: float = 0.0, adamw_mode: bool = True, bias_correction: bool = True,
              grad_scale: float = 1.0, half_copy=None, check_finite: bool = True, seed: int | None = None) -> bool:
    """One Adam/AdamW step on caller-owned buffers; returns ``found_inf``.

    ``params``, ``grads``, ``exp_avg``, ``exp_avg_sq`` (and ``half_copy``) are each a contiguous
    tensor (a flat partition) or a list of them, matched element for element by count, all on one
    device. Parameters are float32 (gradients float32, float16 or bfloat16) or float16/bfloat16
    (gradients of the same dtype, updated in float32 and stored rounded to nearest);
    ``exp_avg``/``exp_avg_sq`` are float32, or bfloat16 (on CPU with stochastic rounding, ``seed``
    picks its noise, default: from ``step``; on a device rounded to nearest).
    ``step`` is this step's number (1 for the first): the caller counts, and does not count a
    skipped step. The formulas are ``torch.optim.Adam``'s (``adamw_mode=False``: L2 weight decay)
    and ``AdamW``'s, on ``g = grad / grad_scale``: the gradients are multiplied by ``1/grad_scale``
    inside the update pass (exact for the powers of two loss scalers use), so unscaling costs no
    pass of its own, and the gradients are left as they are. ``half_copy``: float16/bfloat16
    tensors (float32 parameters only) that receive the updated parameters in the same pass.

    CPU tensors run the ds-ops ``cpu_adam`` kernel. Device (CUDA) tensors run torch's fused
    multi-tensor Adam (``torch._fused_adam_``/``_fused_adamw_``, as ``torch.optim.AdamW(fused=True)``),
    the step without bias correction in ``torch._foreach_*`` ops; 16-bit gradients (and float32 ones
    when ``grad_scale != 1``) and 16-bit parameters pass through float32 scratch of at most 256 MiB,
    the 16-bit copies are written by one ``torch._foreach_copy_``. There the check is a read of the
    gradients' largest magnitudes and the result one host synchronisation, with
    ``check_finite=False`` too (the flag is returned either way).

    Overflow: with ``check_finite=True`` (the default) a read-only pass over the gradients runs
    first; if any ``grad / grad_scale`` is inf or nan, nothing is written (parameters, states and
    ``half_copy`` keep their values) and True is returned: skip the step and lower the loss scale.
    With several ranks the decision must be global: check each rank's gradients with
    ``ds_ops.has_inf_or_nan``, all-reduce the flag, and call this with ``check_finite=False``, which
    costs no pass besides the update and still returns True when it met a non-finite gradient
    (the update has then been written).
    """
    first = params[0] if isinstance(params, (list, tuple)) and params else params
    on_device = torch.is_tensor(first) and first.device.type not in ("cpu", "meta")
    step_fn = _torch_adam_step if on_device else _cpu_adam_step
    return step_fn(params, grads, exp_avg, exp_avg_sq, step, lr, betas=betas, eps=eps, weight_decay=weight_decay,
                   adamw_mode=adamw_mode, bias_correction=bias_correction, grad_scale=grad_scale,
                   half_copy=half_copy, check_finite=check_finite, seed=seed)


def _cpu_adam_step(params, grads, exp_avg, exp_avg_sq, step, lr, *, betas, eps, weight_decay, adamw_mode,
                   bias_correction, grad_scale, half_copy, check_finite, seed) -> bool:
    """adam_step on CPU buffers: the cpu_adam kernel."""
    checked = _check_step(params, grads, exp_avg, exp_avg_sq, half_copy, step, lr, betas, eps, weight_decay,
                          grad_scale, torch.device("cpu"))
    params, grads, exp_avg, exp_avg_sq, copies, grad_scale = checked
    beta1, beta2 = betas
    return _launch(params, grads, exp_avg, exp_avg_sq, copies, step=int(step), lr=lr, beta1=beta1, beta2=beta2,
                   eps=eps, weight_decay=weight_decay, adamw=adamw_mode, bias_correction=bias_correction,
                   grad_multiplier=1.0 / grad_scale, check_finite=check_finite,
                   seed=common.stream_seed(step, 0) if seed is None else int(seed) & 0xFFFFFFFF)


def _torch_adam_step(params, grads, exp_avg, exp_avg_sq, step, lr, *, betas=(0.9, 0.999), eps=1e-8,
                     weight_decay=0.0, adamw_mode=True, bias_correction=True, grad_scale=1.0, half_copy=None,
                     check_finite=True, seed=None) -> bool:
    """adam_step's device path (torch's fused kernels), on the device of ``params`` -- the CPU
    included, which is how CPU CI tests it. bfloat16 states are rounded to nearest (``seed`` is
    not used: no stochastic rounding here)."""
    first = params[0] if isinstance(params, (list, tuple)) and params else params
    device = first.device if torch.is_tensor(first) else torch.device("cpu")
    checked = _check_step(params, grads, exp_avg, exp_avg_sq, half_copy, step, lr, betas, eps, weight_decay,
                          grad_scale, device)
    params, grads, exp_avg, exp_avg_sq, copies, grad_scale = checked
    found_inf = _adam_device.found_non_finite(grads, grad_scale)
    if found_inf and check_finite:
        return True
    beta1, beta2 = betas
    steps = [_adam_device.step_tensor(int(step), device)] * len(params)
    _adam_device.update(params, grads, exp_avg, exp_avg_sq, copies, steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                        weight_decay=weight_decay, adamw=adamw_mode, bias_correction=bias_correction,
                        grad_scale=grad_scale)
    return found_inf


def _check_step(params, grads, exp_avg, exp_avg_sq, half_copy, step, lr, betas, eps, weight_decay, grad_scale,
                device: torch.device):
    """adam_step's input checks (nothing is written before they pass); the lists and the scale."""
    name = "adam_step"
    params, grads = _tensor_list(name, "params", params), _tensor_list(name, "grads", grads)
    exp_avg, exp_avg_sq = _tensor_list(name, "exp_avg", exp_avg), _tensor_list(name, "exp_avg_sq", exp_avg_sq)
    copies = [None] * len(params) if half_copy is None else _tensor_list(name, "half_copy", half_copy)
    for what, tensors in (("grads", grads), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("half_copy", copies)):
        if len(tensors) != len(params):
            raise ValueError(f"{name}: {what} has {len(tensors)} tensors, params {len(params)}")
    for i, (p, g, m, v, c) in enumerate(zip(params, grads, exp_avg, exp_avg_sq, copies, strict=True)):
        _check_buffer(name, f"params[{i}]", p, p.numel(), (torch.float32, *common.HALF_DTYPES), device)
        _check_buffer(name, f"grads[{i}]", g, p.numel(), tuple(common.DTYPE_CODES), device)
        _check_buffer(name, f"exp_avg[{i}]", m, p.numel(), tuple(_STATE_CODES), device)
        _check_buffer(name, f"exp_avg_sq[{i}]", v, p.numel(), tuple(_STATE_CODES), device)
        if p.dtype != torch.float32 and g.dtype != p.dtype:
            raise ValueError(f"{name}: params[{i}] is {p.dtype} and grads[{i}] {g.dtype}; 16-bit parameters need "
                             "gradients of their own dtype")
        if c is not None:
            _check_buffer(name, f"half_copy[{i}]", c, p.numel(), common.HALF_DTYPES, device)
            if p.dtype != torch.float32:
                raise ValueError(f"{name}: half_copy is for float32 parameters; params[{i}] is {p.dtype} already")
    for what, tensors in (("params", params), ("grads", grads), ("exp_avg and exp_avg_sq", exp_avg + exp_avg_sq),
                          ("half_copy", [c for c in copies if c is not None])):
        dtypes = sorted({str(t.dtype) for t in tensors})
        if len(dtypes) > 1:
            raise ValueError(f"{name}: the tensors of {what} must share one dtype, got {', '.join(dtypes)}")
    if (isinstance(step, bool) or not isinstance(step, numbers.Real) or not math.isfinite(step)
            or step != int(step) or step < 1):
        raise ValueError(f"{name}: step must be an integer >= 1 (this step's number), got {step!r}")
    common.check_hyperparameters(name, lr, eps, betas, weight_decay)
    return params, grads, exp_avg, exp_avg_sq, copies, _check_scale(name, grad_scale)


def has_inf_or_nan(grads, grad_scale: float = 1.0) -> bool:
    """True when a value of ``grads`` (a contiguous float32/float16/bfloat16 tensor or a list of
    them, on one device) divided by ``grad_scale`` is inf or nan: one read-only pass that stops at
    the first one (on a device: a multi-tensor read of the largest magnitudes, one synchronisation).
    The per-rank half of a global overflow check (all-reduce the result, then ``adam_step``)."""
    name = "has_inf_or_nan"
    tensors = _tensor_list(name, "grads", grads)
    device = tensors[0].device if tensors[0].device.type != "meta" else torch.device("cpu")
    for i, g in enumerate(tensors):
        _check_buffer(name, f"grads[{i}]", g, g.numel(), tuple(common.DTYPE_CODES), device)
    grad_scale = _check_scale(name, grad_scale)
    if device.type != "cpu":
        return _adam_device.found_non_finite(tensors, grad_scale)
    kernel = CPUAdamBuilder().load()
    by_dtype = defaultdict(list)
    for g in tensors:
        by_dtype[g.dtype].append(g)
    return any(not kernel.all_finite([g.data_ptr() for g in group], [g.numel() for g in group],
                                     common.DTYPE_CODES[dtype], 1.0 / grad_scale, common.num_threads())
               for dtype, group in by_dtype.items())


def _check_scale(name: str, value) -> float:
    """The loss scale as a float (a one-element tensor, as torch's GradScaler keeps it, is read once)."""
    if torch.is_tensor(value) and value.numel() == 1:
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 1e-30 <= value <= 1e30:
        raise ValueError(f"{name}: grad_scale must be a number in [1e-30, 1e30] (the loss scale), got {value!r}")
    return float(value)


def _tensor_list(name: str, what: str, value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(torch.is_tensor(t) for t in value):
        return list(value)
    raise ValueError(f"{name}: {what} must be a tensor or a non-empty list of tensors, got {type(value).__name__}")


_CPU = torch.device("cpu")


def _check_buffer(name: str, what: str, t: torch.Tensor, numel: int, dtypes: tuple,
                  device: torch.device = _CPU) -> None:
    if t.device != device or t.layout != torch.strided or not t.is_contiguous():
        where = "CPU tensor" if device.type == "cpu" else f"tensor on {device}"
        raise ValueError(f"{name}: {what} must be a contiguous dense {where}, got {t.layout} on {t.device}"
                         f"{'' if t.layout != torch.strided or t.is_contiguous() else ', not contiguous'}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: {what} is {t.dtype}; allowed: {', '.join(str(d) for d in dtypes)}")
    if t.numel() != numel:
        raise ValueError(f"{name}: {what} has {t.numel()} elements, its parameter {numel}")


def _launch(params, grads, exp_avg, exp_avg_sq, copies, *, step: float, lr: float, beta1: float, beta2: float,
            eps: float, weight_decay: float, adamw: bool, bias_correction: bool, grad_multiplier: float,
            check_finite: bool, seed: int, report_inf: bool = True) -> bool:
    """The kernel call behind adam_step and the optimizer classes (inputs already checked; one
    dtype per role). Returns found_inf (always False with report_inf=False and no check: the
    optimizer classes, which neither scale nor look, run the kernel without those instructions)."""
    kernel = CPUAdamBuilder().load()
    sizes, threads = [p.numel() for p in params], common.num_threads()
    grad_pointers, grad_code = [g.data_ptr() for g in grads], common.DTYPE_CODES[grads[0].dtype]
    if check_finite and not kernel.all_finite(grad_pointers, sizes, grad_code, grad_multiplier, threads):
        return True
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    out_code = -1 if copies[0] is None else common.DTYPE_CODES[copies[0].dtype]
    scaled = grad_multiplier != 1.0 or (report_inf and not check_finite)
    return kernel.adam_update([p.data_ptr() for p in params], grad_pointers, [m.data_ptr() for m in exp_avg],
                              [v.data_ptr() for v in exp_avg_sq], [0 if c is None else c.data_ptr() for c in copies],
                              sizes, common.DTYPE_CODES[params[0].dtype], grad_code, _STATE_CODES[exp_avg[0].dtype],
                              out_code, lr, beta1, beta2, eps, weight_decay, bc1, bc2, adamw, grad_multiplier, scaled,
                              seed, threads)


class _AdamKernel(torch.optim.Optimizer):
    """The CPU path shared by CPUAdam and FusedAdam: ``adam_step``'s kernel on the optimizer's state."""

    _NAME = "Adam"

    def __init__(self, params, lr: float, bias_correction: bool, betas, eps: float, weight_decay: float,
                 amsgrad: bool, adamw_mode: bool, state_dtype: str):
        if amsgrad:
            raise ValueError(f"{self._NAME} does not support amsgrad (nor does DeepSpeed's); "
                             "use torch.optim.Adam(amsgrad=True) if you need it")
        common.check_hyperparameters(self._NAME, lr, eps, betas, weight_decay)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bias_correction, "amsgrad": False, "maximize": False,
                    "state_dtype": state_dtype}
        super().__init__(params, defaults)
        self.adamw_mode = adamw_mode

    @property
    def adam_w_mode(self) -> bool:
        """DeepSpeed's name of ``adamw_mode``."""
        return self.adamw_mode

    @adam_w_mode.setter
    def adam_w_mode(self, value: bool) -> None:
        self.adamw_mode = value

    def __setstate__(self, state):
        # a state_dict saved by torch.optim.Adam lacks our keys: take the defaults
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("bias_correction", True)
            group.setdefault("state_dtype", "float32")

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load casts every floating-point state to its parameter's dtype, which would round
        float32 states of a 16-bit parameter to 16 bits: keep the saved states' own dtypes."""
        super().load_state_dict(state_dict)
        common.keep_saved_state_dtypes(self, state_dict, ("exp_avg", "exp_avg_sq"))

    def _cpu_step(self, group_index: int, group: dict, params: list[torch.Tensor],
                  copies: list[torch.Tensor | None] | None = None, states: list[dict] | None = None) -> None:
        """One update of ``params`` (of ``group``) on their states, or on ``states`` when given (one
        dict per parameter: CPUAdam.step_subgroup keeps a subgroup's state under its id)."""
        beta1, beta2 = group["betas"]
        # check everything before touching any state: bad input must leave the optimizer as it was
        plans = []
        for i, p in enumerate(params):
            common.check_cpu_param(self._NAME, p, half_params=True)
            copy = copies[i] if copies else None
            if copy is not None:
                if p.dtype != torch.float32:
                    raise ValueError(f"{self._NAME}: parameter of shape {tuple(p.shape)} is {p.dtype} already; "
                                     "a 16-bit copy is for float32 parameters")
                _check_copy(self._NAME, copy, p)
            plans.append((p, copy, common.state_dtype_of(group, p)))
        batches = defaultdict(lambda: ([], [], [], [], []))
        for i, (p, copy, state_dtype) in enumerate(plans):
            state = self.state[p] if states is None else states[i]
            step = common.next_step(state)
            exp_avg = common.state_tensor(state, "exp_avg", p, state_dtype)
            exp_avg_sq = common.state_tensor(state, "exp_avg_sq", p, state_dtype)
            key = (step, p.dtype, p.grad.dtype, state_dtype, None if copy is None else copy.dtype)
            for bucket, tensor in zip(batches[key], (p, p.grad, exp_avg, exp_avg_sq, copy), strict=True):
                bucket.append(tensor)
        for (step, *_), (ps, gs, ms, vs, cs) in batches.items():
            _launch(ps, gs, ms, vs, cs, step=step, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], adamw=self.adamw_mode, bias_correction=group["bias_correction"],
                    grad_multiplier=1.0, check_finite=False, seed=common.stream_seed(step, group_index),
                    report_inf=False)


def _check_copy(name: str, copy: torch.Tensor, p: torch.Tensor) -> int:
    if copy.dtype not in (torch.float16, torch.bfloat16) or copy.device.type != "cpu" or not copy.is_contiguous():
        raise ValueError(f"{name}: the 16-bit copy of a parameter must be a contiguous CPU float16/bfloat16 "
                         f"tensor, got {copy.dtype} on {copy.device}")
    if copy.numel() != p.numel():
        raise ValueError(f"{name}: the 16-bit copy has {copy.numel()} elements, its parameter {p.numel()}")
    return common.DTYPE_CODES[copy.dtype]


class CPUAdam(_AdamKernel):
    """Adam/AdamW on CPU parameters (DeepSpeed's DeepSpeedCPUAdam, same arguments in the same order).

    float32 parameters take float32, float16 or bfloat16 gradients; ``step(fp16_param_groups=...)``
    also writes each updated parameter into a float16/bfloat16 tensor in the same pass (what
    ZeRO-Offload sends back to the device). float16/bfloat16 parameters (gradients of their dtype)
    are updated in place, computed in float32 and rounded to nearest, as DeepSpeed does.
    ``adamw_mode=True`` (the default, as in DeepSpeed; also readable as ``adam_w_mode``) decouples
    weight decay. States: float32 by default; ``fp32_optimizer_states=False`` (DeepSpeed's name)
    keeps them in each parameter's dtype (bfloat16 parameters: bfloat16 states, stochastically
    rounded); ``state_dtype=torch.bfloat16`` keeps them in bfloat16 for every parameter.
    """

    _NAME = "CPUAdam"

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool | None = None, *, state_dtype: torch.dtype | None = None):
        resolved = common.resolve_state_dtype(self._NAME, state_dtype, fp32_optimizer_states)
        super().__init__(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode, resolved)
        self.fp32_optimizer_states = resolved == "float32"

    @torch.no_grad()
    def step(self, closure=None, fp16_param_groups=None):
        """One update. ``fp16_param_groups``: per group, a list of 16-bit tensors aligned with the
        group's parameters (or one tensor per group for a group of one parameter)."""
        loss = common.closure_loss(closure)
        if fp16_param_groups is not None and len(fp16_param_groups) != len(self.param_groups):
            raise ValueError(f"CPUAdam: fp16_param_groups has {len(fp16_param_groups)} groups, "
                             f"the optimizer {len(self.param_groups)}")
        for gi, group in enumerate(self.param_groups):
            copies = None
            if fp16_param_groups is not None:
                copies = fp16_param_groups[gi]
                copies = [copies] if torch.is_tensor(copies) else list(copies)
                if len(copies) != len(group["params"]):
                    raise ValueError(f"CPUAdam: fp16_param_groups[{gi}] has {len(copies)} tensors, "
                                     f"the group {len(group['params'])} parameters")
            kept = [i for i, p in enumerate(group["params"]) if p.grad is not None]
            self._cpu_step(gi, group, [group["params"][i] for i in kept],
                           [copies[i] for i in kept] if copies is not None else None)
        return loss

    @torch.no_grad()
    def step_subgroup(self, subgroup_id: int, closure=None):
        """One step of a ZeRO-3 subgroup (DeepSpeed 0.19's API, what SuperOffload calls): the one
        parameter with a gradient (the subgroup's flat partition) is updated on the state kept in
        ``self.state[subgroup_id]``, with the hyperparameters of its group; bit for bit what
        ``step()`` does. Non-finite gradients write nothing (the step is counted, a warning logged),
        so a rollback of that step is exact."""
        loss = common.closure_loss(closure)
        subgroups.step_subgroup(self, subgroup_id)
        return loss

    @torch.no_grad()
    def rollback_subgroup(self, subgroup_id: int, closure=None):
        """Undo the last ``step_subgroup(subgroup_id)`` (the same parameter, gradient and
        hyperparameters in place), inverting the step algebraically in float32 as DeepSpeed does:
        the parameter and states come back to within a few float32 ulps (exactly to step 0's zero
        states, and exactly after a step that met non-finite gradients). RuntimeError when the
        subgroup has no step to undo; float32 parameters and states only."""
        loss = common.closure_loss(closure)
        subgroups.rollback_subgroup(self, subgroup_id)
        return loss


class FusedAdam(_AdamKernel):
    """Adam/AdamW applied to all tensors of a group in one multi-tensor kernel call per step.

    CPU tensors run the ds-ops ``cpu_adam`` kernel. Device (CUDA) tensors run torch's fused
    multi-tensor Adam (``torch._fused_adam_``/``_fused_adamw_``, the kernel of
    ``torch.optim.AdamW(fused=True)``; ds-ops builds no CUDA kernel of its own), through the same
    code as ``adam_step`` on device buffers: computed in float32 (16-bit parameters and
    ``state_dtype=torch.bfloat16`` states stored rounded to nearest, not stochastically as on
    CPU), ``bias_correction=False`` in ``torch._foreach_*`` ops.
    That path is tested on CPU tensors in CI and on a GPU by the ``cuda``-marked tests.
    """

    _NAME = "FusedAdam"
    _torch_path = False  # True: CPU tensors take the device path too (how the tests run it on CPU)

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, state_dtype: torch.dtype = torch.float32):
        super().__init__(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode,
                         common.resolve_state_dtype(self._NAME, state_dtype, None))
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = common.closure_loss(closure)
        for gi, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            cpu = [p for p in params if p.device.type == "cpu" and not self._torch_path]
            device = [p for p in params if p.device.type != "cpu" or self._torch_path]
            if cpu:
                self._cpu_step(gi, group, cpu)
            if device:
                self._device_step(group, device)
        return loss

    def _device_step(self, group: dict, params: list[torch.Tensor]) -> None:
        """torch's fused kernel over ``params``, one call per (device, dtypes of parameter, gradient, state)."""
        for p in params:  # every check before any state is touched
            _check_device_param(self._NAME, p)
        batches = defaultdict(list)
        for p in params:
            batches[(p.device, p.dtype, p.grad.dtype, common.state_dtype_of(group, p))].append(p)
        beta1, beta2 = group["betas"]
        for (device, _, _, state_dtype), ps in batches.items():
            exp_avgs, exp_avg_sqs, steps = [], [], []
            for p in ps:
                state = self.state[p]
                step = state.get("step", 0.0)
                state["step"] = torch.as_tensor(step, dtype=torch.float32).to(device)
                exp_avgs.append(common.state_tensor(state, "exp_avg", p, state_dtype))
                exp_avg_sqs.append(common.state_tensor(state, "exp_avg_sq", p, state_dtype))
                steps.append(state["step"])
            torch._foreach_add_(steps, 1)
            _adam_device.update(ps, [p.grad for p in ps], exp_avgs, exp_avg_sqs, [None] * len(ps), steps,
                                lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                weight_decay=group["weight_decay"], adamw=self.adamw_mode,
                                bias_correction=group["bias_correction"], grad_scale=1.0)


def _check_device_param(name: str, p: torch.Tensor) -> None:
    """A parameter and its gradient as the device path takes them (contiguous, dense, one device)."""
    where = f"{name}: parameter of shape {tuple(p.shape)} on {p.device}"
    grad = p.grad
    if p.dtype not in (torch.float32, *common.HALF_DTYPES):
        raise ValueError(f"{where} is {p.dtype}; {name} updates float32, bfloat16 or float16 parameters")
    if not p.is_contiguous():
        raise ValueError(f"{where} is not contiguous; call .contiguous() on it before building the optimizer")
    if grad.layout != torch.strided or grad.dtype not in common.DTYPE_CODES or not grad.is_contiguous():
        raise ValueError(f"{where} has a gradient that is {grad.dtype}, {grad.layout}"
                         f"{'' if grad.layout != torch.strided or grad.is_contiguous() else ', not contiguous'}"
                         "; gradients must be dense contiguous tensors of float32, float16 or bfloat16")
    if grad.device != p.device or grad.shape != p.shape:
        raise ValueError(f"{where} has a gradient of shape {tuple(grad.shape)} on {grad.device}")
    if p.dtype in common.HALF_DTYPES and grad.dtype != p.dtype:
        raise ValueError(f"{where} is {p.dtype} and its gradient {grad.dtype}; a 16-bit parameter needs a "
                         "gradient of its own dtype")
