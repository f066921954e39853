"""CPULion: the Lion optimizer (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms")
for float32 CPU parameters, in one fused kernel call per group (DeepSpeed's DeepSpeedCPULion).

    c = b1*m + (1-b1)*g;  p = p*(1 - lr*wd) - lr*sign(c);  m = b2*m + (1-b2)*g
"""

from __future__ import annotations

import torch

from . import _optimizer as common
from .op_builder import CPULionBuilder


class CPULion(torch.optim.Optimizer):
    _NAME = "CPULion"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 state_dtype: torch.dtype = torch.float32):
        common.check_hyperparameters(self._NAME, lr, None, betas, weight_decay)
        common.check_state_dtype(self._NAME, state_dtype)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay,
                                  "state_dtype": common.STATE_DTYPES[state_dtype]})

    @torch.no_grad()
    def step(self, closure=None):
        loss = common.closure_loss(closure)
        kernel = CPULionBuilder().load()
        for gi, group in enumerate(self.param_groups):
            state_dtype = torch.bfloat16 if group["state_dtype"] == "bfloat16" else torch.float32
            beta1, beta2 = group["betas"]
            batches = common.Batches()
            for p in group["params"]:
                if p.grad is None:
                    continue
                common.check_cpu_param(self._NAME, p)
                state = self.state[p]
                step = common.next_step(state)
                exp_avg = common.state_tensor(state, "exp_avg", p, state_dtype)
                batches.add((step, common.DTYPE_CODES[p.grad.dtype]), params=p, grads=p.grad, exp_avg=exp_avg,
                            sizes=p.numel())

            def run(key, batch, group=group, gi=gi, state_dtype=state_dtype, beta1=beta1, beta2=beta2):
                step, grad_code = key
                kernel.lion_update(batch["params"], batch["grads"], batch["exp_avg"], batch["sizes"], grad_code,
                                   common.DTYPE_CODES[state_dtype], group["lr"], beta1, beta2,
                                   group["weight_decay"], common.stream_seed(step, gi), common.num_threads())

            batches.run(run)
        return loss
