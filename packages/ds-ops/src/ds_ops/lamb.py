"""FusedLamb: LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning") with the trust
ratio clamped to [min_coeff, max_coeff], as DeepSpeed's FusedLamb.

    m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g^2;  m^ = m/(1-b1^t);  v^ = v/(1-b2^t)
    u = m^ / (sqrt(v^) + eps) + wd*p;  r = clamp(|p| / |u|, min_coeff, max_coeff)  (1 if a norm is 0)
    p = p - lr * r * u

CPU tensors run the ``cpu_lamb`` kernel (two passes per tensor, no temporary); other devices (CUDA)
run the same equations with torch ops, float32 states, the trust ratio computed on the device and
the step's ratios read back once at its end (``lamb_coeffs``). That path is tested on CPU tensors
in CI (``_torch_path``) and on a GPU by the ``cuda``-marked tests.
"""

from __future__ import annotations

import torch

from . import _optimizer as common
from .op_builder import CPULambBuilder


class FusedLamb(torch.optim.Optimizer):
    _NAME = "FusedLamb"
    _torch_path = False  # True: CPU tensors take the device path too (how the tests run it on CPU)

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False,
                 state_dtype: torch.dtype = torch.float32):
        if amsgrad:
            raise ValueError("FusedLamb does not support amsgrad (nor does DeepSpeed's)")
        common.check_hyperparameters(self._NAME, lr, eps, betas, weight_decay)
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"FusedLamb: need 0 <= min_coeff <= max_coeff, got min_coeff={min_coeff}, "
                             f"max_coeff={max_coeff}")
        if not max_grad_norm >= 0.0:
            raise ValueError(f"FusedLamb: max_grad_norm must be >= 0 (0 turns clipping off), got {max_grad_norm}")
        common.check_state_dtype(self._NAME, state_dtype)
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction, "betas": tuple(betas), "eps": eps,
                                  "eps_inside_sqrt": eps_inside_sqrt, "weight_decay": weight_decay,
                                  "max_grad_norm": max_grad_norm, "max_coeff": max_coeff, "min_coeff": min_coeff,
                                  "state_dtype": common.STATE_DTYPES[state_dtype]})
        self.lamb_coeffs: list[float] = []  # the trust ratios of the last step, parameter by parameter

    @torch.no_grad()
    def step(self, closure=None):
        loss = common.closure_loss(closure)
        coeffs = []  # floats (CPU kernel) and device scalars (torch path), read once at the end
        for gi, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if group["state_dtype"] != "float32" and any(p.device.type != "cpu" or self._torch_path for p in params):
                raise ValueError("FusedLamb: state_dtype=torch.bfloat16 is supported for CPU tensors only "
                                 "(device tensors keep float32 states)")
            scale = self._clip_scale(group, params)
            for p in params:
                step = common.next_step(self.state[p])
                if p.device.type == "cpu" and not self._torch_path:
                    coeffs.append(self._cpu_update(gi, group, p, step, scale))
                else:
                    coeffs.append(self._torch_update(group, p, step, scale))
        tensors = [c for c in coeffs if torch.is_tensor(c)]
        values = iter(torch.stack([c.to(tensors[0].device) for c in tensors]).tolist() if tensors else [])
        self.lamb_coeffs = [next(values) if torch.is_tensor(c) else c for c in coeffs]
        return loss

    @staticmethod
    def _clip_scale(group: dict, params: list[torch.Tensor]) -> float:
        """The factor that brings the group's gradient norm down to max_grad_norm (1 when off)."""
        if group["max_grad_norm"] <= 0.0 or not params:
            return 1.0
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params]))
        return min(1.0, group["max_grad_norm"] / (float(norm) + 1e-6))

    def _bias_corrections(self, group: dict, step: float) -> tuple[float, float]:
        if not group["bias_correction"]:
            return 1.0, 1.0
        beta1, beta2 = group["betas"]
        return 1.0 - beta1**step, 1.0 - beta2**step

    def _cpu_update(self, gi: int, group: dict, p: torch.Tensor, step: float, scale: float) -> float:
        common.check_cpu_param(self._NAME, p)
        state_dtype = common.state_dtype_of(group)
        state = self.state[p]
        m = common.state_tensor(state, "exp_avg", p, state_dtype)
        v = common.state_tensor(state, "exp_avg_sq", p, state_dtype)
        bc1, bc2 = self._bias_corrections(group, step)
        beta1, beta2 = group["betas"]
        (ratio,) = CPULambBuilder().load().lamb_update(
            [p.data_ptr()], [p.grad.data_ptr()], [m.data_ptr()], [v.data_ptr()], [p.numel()],
            common.DTYPE_CODES[p.grad.dtype], common.DTYPE_CODES[state_dtype], group["lr"], beta1, beta2,
            group["eps"], group["weight_decay"], bc1, bc2, group["max_coeff"], group["min_coeff"], scale,
            group["eps_inside_sqrt"], common.stream_seed(step, gi), common.num_threads())
        return ratio

    def _torch_update(self, group: dict, p: torch.Tensor, step: float, scale: float) -> torch.Tensor:
        """The update in torch ops on ``p``'s device; returns the trust ratio as a device scalar (no
        synchronisation per parameter)."""
        state = self.state[p]
        m = common.state_tensor(state, "exp_avg", p, torch.float32)
        v = common.state_tensor(state, "exp_avg_sq", p, torch.float32)
        beta1, beta2 = group["betas"]
        bc1, bc2 = self._bias_corrections(group, step)
        g = p.grad.float() * scale
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        v_hat = v / bc2
        denom = (v_hat + group["eps"]).sqrt() if group["eps_inside_sqrt"] else v_hat.sqrt() + group["eps"]
        u = (m / bc1) / denom + group["weight_decay"] * p.float()
        p_norm, u_norm = torch.linalg.vector_norm(p.float()), torch.linalg.vector_norm(u)
        ratio = torch.where((p_norm > 0) & (u_norm > 0), p_norm / u_norm, torch.ones_like(p_norm))
        ratio = ratio.clamp(group["min_coeff"], group["max_coeff"])
        p.addcmul_(u, ratio, value=-group["lr"])
        return ratio
