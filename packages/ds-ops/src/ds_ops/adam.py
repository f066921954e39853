"""CPUAdam (the optimizer of ZeRO-Offload) and FusedAdam.

Both update every tensor of a parameter group in one call of the ``cpu_adam`` kernel: a single
vectorised, multi-threaded pass over memory that reads p, g, m, v and writes p, m, v back (and, for
CPUAdam, a float16/bfloat16 copy of p in the same pass). State layout and formulas are those of
``torch.optim.Adam`` / ``AdamW``, so a checkpoint moves between them. ``state_dtype=torch.bfloat16``
keeps ``exp_avg``/``exp_avg_sq`` in bfloat16 with stochastic rounding: 20 instead of 28 bytes per
parameter per step and half the optimizer-state memory; the master parameters stay float32.
"""

from __future__ import annotations

import logging

import torch

from . import _optimizer as common
from .op_builder import CPUAdamBuilder

logger = logging.getLogger(__name__)


class _AdamKernel(torch.optim.Optimizer):
    """The CPU path shared by CPUAdam and FusedAdam."""

    _NAME = "Adam"

    def __init__(self, params, lr: float, bias_correction: bool, betas, eps: float, weight_decay: float,
                 amsgrad: bool, adamw_mode: bool, state_dtype: torch.dtype):
        if amsgrad:
            raise ValueError(f"{self._NAME} does not support amsgrad (nor does DeepSpeed's); "
                             "use torch.optim.Adam(amsgrad=True) if you need it")
        common.check_hyperparameters(self._NAME, lr, eps, betas, weight_decay)
        common.check_state_dtype(self._NAME, state_dtype)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bias_correction, "amsgrad": False, "maximize": False,
                    "state_dtype": common.STATE_DTYPES[state_dtype]}
        super().__init__(params, defaults)
        self.adamw_mode = adamw_mode

    def __setstate__(self, state):
        # a state_dict saved by torch.optim.Adam lacks our keys: take the defaults
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("bias_correction", True)
            group.setdefault("state_dtype", "float32")

    def _cpu_step(self, group_index: int, group: dict, params: list[torch.Tensor],
                  copies: list[torch.Tensor | None] | None = None) -> None:
        kernel = CPUAdamBuilder().load()
        state_dtype = common.state_dtype_of(group)
        beta1, beta2 = group["betas"]
        # check everything before touching any state: bad input must leave the optimizer as it was
        out_codes = []
        for i, p in enumerate(params):
            common.check_cpu_param(self._NAME, p)
            out_codes.append(-1 if not copies or copies[i] is None else _check_copy(self._NAME, copies[i], p))
        batches = common.Batches()
        for i, p in enumerate(params):
            state = self.state[p]
            step = common.next_step(state)
            exp_avg = common.state_tensor(state, "exp_avg", p, state_dtype)
            exp_avg_sq = common.state_tensor(state, "exp_avg_sq", p, state_dtype)
            copy, out_code = (copies[i] if copies else None), out_codes[i]
            batches.add((step, common.DTYPE_CODES[p.grad.dtype], out_code), params=p, grads=p.grad,
                        exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, outs=0 if copy is None else copy,
                        sizes=p.numel())

        def run(key, batch):
            step, grad_code, out_code = key
            bc1 = 1.0 - beta1**step if group["bias_correction"] else 1.0
            bc2 = 1.0 - beta2**step if group["bias_correction"] else 1.0
            kernel.adam_update(batch["params"], batch["grads"], batch["exp_avg"], batch["exp_avg_sq"], batch["outs"],
                               batch["sizes"], grad_code, common.DTYPE_CODES[state_dtype], out_code, group["lr"],
                               beta1, beta2, group["eps"], group["weight_decay"], bc1, bc2, self.adamw_mode,
                               common.stream_seed(step, group_index), common.num_threads())

        batches.run(run)


def _check_copy(name: str, copy: torch.Tensor, p: torch.Tensor) -> int:
    if copy.dtype not in (torch.float16, torch.bfloat16) or copy.device.type != "cpu" or not copy.is_contiguous():
        raise ValueError(f"{name}: the 16-bit copy of a parameter must be a contiguous CPU float16/bfloat16 "
                         f"tensor, got {copy.dtype} on {copy.device}")
    if copy.numel() != p.numel():
        raise ValueError(f"{name}: the 16-bit copy has {copy.numel()} elements, its parameter {p.numel()}")
    return common.DTYPE_CODES[copy.dtype]


class CPUAdam(_AdamKernel):
    """Adam/AdamW for float32 parameters on the CPU (DeepSpeed's DeepSpeedCPUAdam).

    Gradients may be float32, float16 or bfloat16. ``step(fp16_param_groups=...)`` also writes each
    updated parameter into a float16/bfloat16 tensor in the same pass (what ZeRO-Offload sends back
    to the device). ``adamw_mode=True`` (the default, as in DeepSpeed) decouples weight decay.
    """

    _NAME = "CPUAdam"

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 state_dtype: torch.dtype = torch.float32):
        super().__init__(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode, state_dtype)

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


class FusedAdam(_AdamKernel):
    """Adam/AdamW applied to all tensors of a group in one multi-tensor kernel call per step.

    CPU tensors run the ds-ops ``cpu_adam`` kernel. Device (CUDA) tensors run torch's fused
    multi-tensor Adam (``torch._fused_adam_``/``_fused_adamw_``); that path has not yet been verified on
    a GPU in this project, and it needs ``bias_correction=True`` (torch's kernel always corrects).
    """

    _NAME = "FusedAdam"
    _warned_device = False

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, state_dtype: torch.dtype = torch.float32):
        super().__init__(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode, state_dtype)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = common.closure_loss(closure)
        for gi, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            cpu = [p for p in params if p.device.type == "cpu"]
            device = [p for p in params if p.device.type != "cpu"]
            if cpu:
                self._cpu_step(gi, group, cpu)
            if device:
                self._device_step(group, device)
        return loss

    def _device_step(self, group: dict, params: list[torch.Tensor]) -> None:
        if not group["bias_correction"]:
            raise ValueError("FusedAdam: bias_correction=False is supported for CPU tensors only "
                             "(torch's fused device kernel always corrects)")
        if common.state_dtype_of(group) != torch.float32:
            raise ValueError("FusedAdam: state_dtype=torch.bfloat16 is supported for CPU tensors only")
        if not FusedAdam._warned_device:
            logger.warning("FusedAdam on %s uses torch's fused Adam kernel; this path has not been verified on a "
                           "GPU in ds-ops yet", params[0].device)
            FusedAdam._warned_device = True
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["step"] = state["step"].to(p.device)
            exp_avgs.append(common.state_tensor(state, "exp_avg", p, p.dtype))
            exp_avg_sqs.append(common.state_tensor(state, "exp_avg_sq", p, p.dtype))
            steps.append(state["step"])
        fused = torch._fused_adamw_ if self.adamw_mode else torch._fused_adam_
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1)
        fused(params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps, lr=group["lr"], beta1=beta1,
              beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False)

