"""CPULion: the Lion optimizer (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms")
for CPU parameters, in one fused kernel call per group (DeepSpeed's DeepSpeedCPULion).

    c = b1*m + (1-b1)*g;  p = p*(1 - lr*wd) - lr*sign(c);  m = b2*m + (1-b2)*g
"""

from __future__ import annotations

import torch

from . import _optimizer as common
from .op_builder import CPULionBuilder


class CPULion(torch.optim.Optimizer):
    """Lion on CPU parameters (DeepSpeed's DeepSpeedCPULion, same arguments in the same order).

    float32 parameters take float32, float16 or bfloat16 gradients. float16/bfloat16 parameters
    (gradients of their dtype) are updated in place, computed in float32 and rounded to nearest
    even, as DeepSpeed does. The momentum ``exp_avg`` is float32 by default;
    ``fp32_optimizer_states=False`` (DeepSpeed's name) keeps it in each parameter's dtype (bfloat16
    parameters: bfloat16, stochastically rounded; float16 is refused); ``state_dtype=torch.bfloat16``
    keeps it in bfloat16 for every parameter.
    """

    _NAME = "CPULion"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 fp32_optimizer_states: bool | None = None, *, state_dtype: torch.dtype | None = None):
        common.check_hyperparameters(self._NAME, lr, None, betas, weight_decay)
        resolved = common.resolve_state_dtype(self._NAME, state_dtype, fp32_optimizer_states)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay,
                                  "state_dtype": resolved})
        self.fp32_optimizer_states = resolved == "float32"

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("state_dtype", "float32")

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load would round the float32 momentum of a 16-bit parameter to 16 bits: kept as saved."""
        super().load_state_dict(state_dict)
        common.keep_saved_state_dtypes(self, state_dict, ("exp_avg",))

    @torch.no_grad()
    def step(self, closure=None):
        loss = common.closure_loss(closure)
        kernel = CPULionBuilder().load()
        for gi, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            plans = []
            for p in params:  # all checks first: bad input must leave every state as it was
                common.check_cpu_param(self._NAME, p, half_params=True)
                plans.append((p, common.state_dtype_of(group, p)))
            batches = common.Batches()
            for p, state_dtype in plans:
                state = self.state[p]
                step = common.next_step(state)
                exp_avg = common.state_tensor(state, "exp_avg", p, state_dtype)
                key = (step, common.DTYPE_CODES[p.dtype], common.DTYPE_CODES[p.grad.dtype],
                       common.DTYPE_CODES[state_dtype])
                batches.add(key, params=p, grads=p.grad, exp_avg=exp_avg, sizes=p.numel())

            def run(key, batch, group=group, gi=gi):
                step, param_code, grad_code, state_code = key
                beta1, beta2 = group["betas"]
                kernel.lion_update(batch["params"], batch["grads"], batch["exp_avg"], batch["sizes"], param_code,
                                   grad_code, state_code, group["lr"], beta1, beta2, group["weight_decay"],
                                   common.stream_seed(step, gi), common.num_threads())

            batches.run(run)
        return loss
