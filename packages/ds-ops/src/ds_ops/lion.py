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
            batches = common.batch_group(self, self._NAME, group, {"exp_avg": 0.0})

            def run(key, batch, group=group, gi=gi):
                step, grad_code = key
                beta1, beta2 = group["betas"]
                kernel.lion_update(batch["params"], batch["grads"], batch["exp_avg"], batch["sizes"], grad_code,
                                   common.DTYPE_CODES[common.state_dtype_of(group)], group["lr"], beta1, beta2,
                                   group["weight_decay"], common.stream_seed(step, gi), common.num_threads())

            batches.run(run)
        return loss
