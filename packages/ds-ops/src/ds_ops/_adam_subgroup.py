"""CPUAdam's ZeRO-3 subgroup API (DeepSpeed 0.19's ``step_subgroup`` / ``rollback_subgroup``, what
SuperOffload calls): one Adam step of a subgroup's flat partition on a state kept under the
subgroup's id, and the step undone.

DeepSpeed's contract, kept here: the partition is the one parameter that has a gradient (the
caller puts it into a param group and hands it the gradient); its state ``{"step", "exp_avg",
"exp_avg_sq"}`` is ``optimizer.state[subgroup_id]``; the group holding the parameter gives the
hyperparameters. A rollback gets the same parameter, gradient and hyperparameters as the step it
undoes and inverts that step algebraically, in float32, as DeepSpeed does (no copy is kept):

    p = (p' + lr/bc1 * m'/(sqrt(v')/sqrt(bc2) + eps)) / (1 - lr*wd)      (AdamW; Adam: no division)
    m = (m' - (1-b1)*g) / b1;   v = max((v' - (1-b2)*g*g) / b2, 0)      (Adam: g = grad + wd*p)

which restores p, m, v to within a few float32 ulps of their magnitudes (see the tests), and
exactly in two cases: back to step 0 the states are the zeros they started from, and a step whose
gradients were not finite wrote nothing (see ``step_subgroup``), so undoing it only uncounts it.
"""

from __future__ import annotations

import logging
import numbers

import torch

from . import _optimizer as common
from .op_builder import CPUAdamBuilder

logger = logging.getLogger(__name__)


def _check_id(name: str, subgroup_id) -> int:
    if isinstance(subgroup_id, bool) or not isinstance(subgroup_id, numbers.Integral):
        raise ValueError(f"{name}: subgroup_id must be an integer (the subgroup's index), got {subgroup_id!r}")
    return int(subgroup_id)


def _the_parameter(optimizer, name: str, subgroup_id: int) -> tuple[int, dict, torch.Tensor]:
    """The one parameter with a gradient across the param groups (the subgroup's partition), its group."""
    found = [(gi, group, p) for gi, group in enumerate(optimizer.param_groups) for p in group["params"]
             if p.grad is not None]
    if len(found) != 1:
        raise ValueError(f"{optimizer._NAME}.{name}({subgroup_id}): exactly one parameter must have a gradient "
                         f"(the subgroup's flat partition, as DeepSpeed's ZeRO-3 hands it in), found {len(found)}; "
                         "set the gradients of the others to None")
    return found[0]


def _check_state_size(optimizer, name: str, subgroup_id: int, state: dict, p: torch.Tensor) -> None:
    for key in ("exp_avg", "exp_avg_sq"):
        tensor = state.get(key)
        if tensor is not None and tensor.numel() != p.numel():
            raise ValueError(f"{optimizer._NAME}.{name}({subgroup_id}): the subgroup's {key} has {tensor.numel()} "
                             f"elements, the parameter {p.numel()}; a subgroup id belongs to one partition")


def skipped(optimizer) -> set[int]:
    """The subgroups whose last step met non-finite gradients and wrote nothing (not checkpointed)."""
    return optimizer.__dict__.setdefault("_skipped_subgroups", set())


def step_subgroup(optimizer, subgroup_id) -> None:
    """One Adam step of the subgroup's partition on ``optimizer.state[subgroup_id]`` (made on first
    use; float32, or as ``fp32_optimizer_states``/``state_dtype`` say), bit for bit what ``step()``
    does to a parameter with that state. Gradients with an inf or nan (checked in one read-only pass
    first) write nothing and count the step, so ``rollback_subgroup`` undoes it exactly; DeepSpeed
    writes the nans, and its rollback then sets such parameters to 0."""
    name = "step_subgroup"
    subgroup_id = _check_id(name, subgroup_id)
    gi, group, p = _the_parameter(optimizer, name, subgroup_id)
    common.check_cpu_param(optimizer._NAME, p, half_params=True)
    state = optimizer.state[subgroup_id]
    _check_state_size(optimizer, name, subgroup_id, state, p)
    kernel = CPUAdamBuilder().load()
    grad = p.grad
    if not kernel.all_finite([grad.data_ptr()], [grad.numel()], common.DTYPE_CODES[grad.dtype], 1.0,
                             common.num_threads()):
        state_dtype = common.state_dtype_of(group, p)  # the refusals of a finite step, before any write
        common.next_step(state)
        for key in ("exp_avg", "exp_avg_sq"):
            common.state_tensor(state, key, p, state_dtype)
        skipped(optimizer).add(subgroup_id)
        logger.warning("%s.step_subgroup(%d): the gradients hold inf or nan; the step is counted and nothing "
                       "is written (rollback_subgroup(%d) uncounts it)", optimizer._NAME, subgroup_id, subgroup_id)
        return
    optimizer._cpu_step(gi, group, [p], states=[state])
    skipped(optimizer).discard(subgroup_id)


def rollback_subgroup(optimizer, subgroup_id) -> None:
    """Undo the last ``step_subgroup(subgroup_id)``: the same parameter, gradient and
    hyperparameters must be in place. float32 parameters and states only (as DeepSpeed's)."""
    name = "rollback_subgroup"
    subgroup_id = _check_id(name, subgroup_id)
    state = optimizer.state.get(subgroup_id)
    if not state:
        raise RuntimeError(f"{optimizer._NAME}.{name}({subgroup_id}): the subgroup has no state; "
                           "step_subgroup has not stepped it")
    step = float(state.get("step", 0))
    if step <= 0:
        raise RuntimeError(f"{optimizer._NAME}.{name}({subgroup_id}): the subgroup's step count is {step:g}; "
                           "there is no step to undo")
    _, group, p = _the_parameter(optimizer, name, subgroup_id)
    common.check_cpu_param(optimizer._NAME, p, half_params=True)
    _check_state_size(optimizer, name, subgroup_id, state, p)
    if subgroup_id in skipped(optimizer):  # that step wrote nothing
        skipped(optimizer).discard(subgroup_id)
        state["step"] = state["step"] - 1
        return
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    dtypes = {"the parameter": p.dtype, "exp_avg": getattr(m, "dtype", None), "exp_avg_sq": getattr(v, "dtype", None)}
    for what, dtype in dtypes.items():
        if dtype != torch.float32:
            raise ValueError(f"{optimizer._NAME}.{name}({subgroup_id}): {what} is {dtype}; a rollback inverts "
                             "float32 parameters and float32 states only (as DeepSpeed's): 16-bit values "
                             "cannot be recovered from their rounding")
    _invert_adam_step(p, p.grad, m, v, step=step, group=group, adamw=optimizer.adamw_mode,
                      where=f"{name}({subgroup_id})")
    state["step"] = state["step"] - 1


def _invert_adam_step(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: float,
                      group: dict, adamw: bool, where: str) -> None:
    """In place: p, m, v as they were before the Adam step number ``step`` with this gradient."""
    beta1, beta2 = group["betas"]
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    # the constants as the kernel forms them (double, then float32)
    bc1 = 1.0 - beta1**step if group["bias_correction"] else 1.0
    bc2 = 1.0 - beta2**step if group["bias_correction"] else 1.0
    decay = 1.0 - lr * weight_decay if adamw else 1.0
    if decay == 0.0:
        raise RuntimeError(f"CPUAdam.{where}: the step multiplied the parameters by 1 - lr*weight_decay = 0; "
                           "they cannot be recovered")
    flat_p, flat_m, flat_v = p.view(-1), m.view(-1), v.view(-1)
    g = grad.reshape(-1).float()
    denom = flat_v.sqrt().mul_(1.0 / bc2**0.5).add_(eps)
    before = flat_p + (lr / bc1) * (flat_m / denom)
    del denom
    if adamw and weight_decay != 0.0:
        before.div_(decay)
    elif not adamw and weight_decay != 0.0:
        g = g + weight_decay * before  # the L2 term the step added to the gradient
    if step == 1:  # the states a first step starts from
        flat_m.zero_()
        flat_v.zero_()
    else:
        if beta1 > 0.0:
            flat_m.sub_(g, alpha=1.0 - beta1).div_(beta1)
        else:  # m' was g alone: the old m never counts again
            flat_m.zero_()
        if beta2 > 0.0:
            flat_v.addcmul_(g, g, value=-(1.0 - beta2)).div_(beta2).clamp_(min=0.0)
        else:
            flat_v.zero_()
    flat_p.copy_(before)
