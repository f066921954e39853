"""CPUAdagrad: torch.optim.Adagrad's update for float32 CPU parameters, in one fused kernel call
per group (DeepSpeed's DeepSpeedCPUAdagrad, same arguments in the same order). State layout
(``sum``, ``step``) is torch's.

Sparse gradients (``torch.nn.Embedding(sparse=True)``) update only the rows they touch, as
torch's Adagrad does: the touched rows of the parameter and of ``sum`` are gathered, stepped by
the same kernel, and scattered back, so a step costs O(touched rows), not O(table).
"""

from __future__ import annotations

import math

import torch

from . import _optimizer as common
from .op_builder import CPUAdagradBuilder


class CPUAdagrad(torch.optim.Optimizer):
    _NAME = "CPUAdagrad"

    def __init__(self, params, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0, amsgrad: bool = False,
                 fp32_optimizer_states: bool | None = None, *, lr_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, state_dtype: torch.dtype | None = None):
        common.check_hyperparameters(self._NAME, lr, eps, None, weight_decay)
        if amsgrad:
            raise ValueError(f"{self._NAME}: amsgrad=True has no meaning for Adagrad (DeepSpeed accepts and ignores "
                             "it); leave it False")
        if not lr_decay >= 0.0 or not initial_accumulator_value >= 0.0:
            raise ValueError(f"{self._NAME}: lr_decay and initial_accumulator_value must be >= 0, "
                             f"got {lr_decay} and {initial_accumulator_value}")
        resolved = common.resolve_state_dtype(self._NAME, state_dtype, fp32_optimizer_states)
        super().__init__(params, {"lr": lr, "lr_decay": lr_decay, "weight_decay": weight_decay,
                                  "initial_accumulator_value": initial_accumulator_value, "eps": eps,
                                  "maximize": False, "state_dtype": resolved})
        self.fp32_optimizer_states = resolved != "bfloat16"  # parameters are float32 here

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("state_dtype", "float32")

    @torch.no_grad()
    def step(self, closure=None):
        loss = common.closure_loss(closure)
        kernel = CPUAdagradBuilder().load()
        for gi, group in enumerate(self.param_groups):
            with_grad = [p for p in group["params"] if p.grad is not None]
            sparse = [p for p in with_grad if p.grad.is_sparse]
            for p in sparse:  # all checks first: bad input must leave every state as it was
                self._check_sparse(group, p)
            dense = [p for p in with_grad if not p.grad.is_sparse]
            batches = common.batch_group(self, self._NAME, group, {"sum": group["initial_accumulator_value"]},
                                         params=dense)

            def run(key, batch, group=group, gi=gi):
                step, grad_code = key
                kernel.adagrad_update(batch["params"], batch["grads"], batch["sum"], batch["sizes"], grad_code,
                                      common.DTYPE_CODES[common.state_dtype_of(group)], self._clr(group, step),
                                      group["eps"], group["weight_decay"], common.stream_seed(step, gi),
                                      common.num_threads())

            batches.run(run)
            for p in sparse:
                self._sparse_step(kernel, gi, group, p)
        return loss

    @staticmethod
    def _clr(group: dict, step: float) -> float:
        return group["lr"] / (1.0 + (step - 1.0) * group["lr_decay"])

    def _check_sparse(self, group: dict, p: torch.Tensor) -> None:
        where = f"{self._NAME}: parameter of shape {tuple(p.shape)}"
        if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
            raise ValueError(f"{where} is {p.dtype} on {p.device}{'' if p.is_contiguous() else ', not contiguous'}; "
                             "a parameter with a sparse gradient must be a contiguous float32 CPU tensor")
        grad = p.grad
        if grad.layout != torch.sparse_coo or grad.device.type != "cpu" or grad.dtype not in common.DTYPE_CODES:
            raise ValueError(f"{where} has a sparse gradient of layout {grad.layout}, {grad.dtype} on {grad.device}; "
                             "sparse gradients must be CPU sparse COO tensors of float32, float16 or bfloat16")
        if grad.shape != p.shape:
            raise ValueError(f"{where} has a gradient of shape {tuple(grad.shape)}")
        if group["weight_decay"] != 0.0:
            raise ValueError(f"{where} has a sparse gradient and weight_decay={group['weight_decay']}; weight decay "
                             "does not work with sparse gradients (as in torch.optim.Adagrad): use weight_decay=0 "
                             "for this parameter's group, or a dense gradient")

    def _sparse_step(self, kernel, gi: int, group: dict, p: torch.Tensor) -> None:
        """torch.optim.Adagrad's sparse update: the dense update restricted to the rows the
        (coalesced) gradient touches, which is what it is, since an untouched row has g = 0."""
        state = self.state[p]
        step = common.next_step(state)
        state_dtype = common.state_dtype_of(group, p)
        total = common.state_tensor(state, "sum", p, state_dtype, group["initial_accumulator_value"])
        grad = p.grad.coalesce()
        if grad._nnz() == 0:
            return
        k = grad.sparse_dim()
        rows = math.prod(p.shape[:k])
        strides = torch.tensor([math.prod(p.shape[d + 1:k]) for d in range(k)], dtype=torch.int64)
        index = (grad.indices() * strides[:, None]).sum(0)  # the touched rows of p viewed as [rows, -1]
        values = grad.values().reshape(index.numel(), -1).contiguous()
        p_rows, sum_rows = p.view(rows, -1), total.view(rows, -1)
        p_touched, sum_touched = p_rows.index_select(0, index), sum_rows.index_select(0, index)
        kernel.adagrad_update([p_touched.data_ptr()], [values.data_ptr()], [sum_touched.data_ptr()],
                              [p_touched.numel()], common.DTYPE_CODES[values.dtype],
                              common.DTYPE_CODES[state_dtype], self._clr(group, step), group["eps"], 0.0,
                              common.stream_seed(step, gi), common.num_threads())
        p_rows.index_copy_(0, index, p_touched)
        sum_rows.index_copy_(0, index, sum_touched)
