"""CPUAdagrad: torch.optim.Adagrad's update for float32 CPU parameters, in one fused kernel call
per group (DeepSpeed's DeepSpeedCPUAdagrad). State layout (``sum``, ``step``) is torch's."""

from __future__ import annotations

import torch

from . import _optimizer as common
from .op_builder import CPUAdagradBuilder


class CPUAdagrad(torch.optim.Optimizer):
    _NAME = "CPUAdagrad"

    def __init__(self, params, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, state_dtype: torch.dtype = torch.float32):
        common.check_hyperparameters(self._NAME, lr, eps, None, weight_decay)
        if not lr_decay >= 0.0 or not initial_accumulator_value >= 0.0:
            raise ValueError(f"{self._NAME}: lr_decay and initial_accumulator_value must be >= 0, "
                             f"got {lr_decay} and {initial_accumulator_value}")
        common.check_state_dtype(self._NAME, state_dtype)
        super().__init__(params, {"lr": lr, "lr_decay": lr_decay, "weight_decay": weight_decay,
                                  "initial_accumulator_value": initial_accumulator_value, "eps": eps,
                                  "maximize": False, "state_dtype": common.STATE_DTYPES[state_dtype]})

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("state_dtype", "float32")

    @torch.no_grad()
    def step(self, closure=None):
        loss = common.closure_loss(closure)
        kernel = CPUAdagradBuilder().load()
        for gi, group in enumerate(self.param_groups):
            batches = common.batch_group(self, self._NAME, group, {"sum": group["initial_accumulator_value"]})

            def run(key, batch, group=group, gi=gi):
                step, grad_code = key
                clr = group["lr"] / (1.0 + (step - 1.0) * group["lr_decay"])
                kernel.adagrad_update(batch["params"], batch["grads"], batch["sum"], batch["sizes"], grad_code,
                                      common.DTYPE_CODES[common.state_dtype_of(group)], clr, group["eps"],
                                      group["weight_decay"], common.stream_seed(step, gi), common.num_threads())

            batches.run(run)
        return loss
