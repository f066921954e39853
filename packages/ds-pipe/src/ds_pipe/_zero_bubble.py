"""The backward split of zero-bubble schedules: input gradients now, weight gradients later.

While a zero-bubble forward runs, every ``nn.Linear`` of the stage computes its output from detached
weights, keeps its input, and catches the gradient of its output as the input-gradient pass (B) goes
by. B therefore costs what the forward does (no weight-gradient GEMMs); the weight-gradient pass (W)
then does those GEMMs from what was kept, ``grad_W += g^T x`` and ``grad_b += sum(g)``, where the
schedule puts it (in the bubble). Parameters outside linear layers (norms, embeddings) get their
gradients in B, as usual: they are cheap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DeferredLinearGrads:
    def __init__(self, modules: list[nn.Module]):
        self._linears = [m for root in modules for m in root.modules() if type(m) is nn.Linear]
        self.current: tuple[int, int] | None = None  # the (micro_batch, chunk) whose forward is running
        self._records: dict[tuple[int, int], list] = {}
        for linear in self._linears:
            linear.forward = self._forward_of(linear)

    def _forward_of(self, linear: nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if self.current is None or not torch.is_grad_enabled() or not x.requires_grad:
                return F.linear(x, linear.weight, linear.bias)
            bias = linear.bias.detach() if linear.bias is not None else None
            y = F.linear(x, linear.weight.detach(), bias)
            record = [linear, x.detach(), None]
            self._records.setdefault(self.current, []).append(record)

            def keep(grad, record=record):
                record[2] = grad if record[2] is None else record[2] + grad
            y.register_hook(keep)
            return y
        return forward

    def weight_pass(self, micro_batch: int, chunk: int) -> None:
        """The deferred weight gradients of one micro-batch's forward (after its input-gradient pass)."""
        for linear, x, g in self._records.pop((micro_batch, chunk), []):
            if g is None:  # this output did not reach the loss
                continue
            g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
            weight = linear.weight
            if weight.requires_grad:
                if weight.grad is None:
                    weight.grad = torch.mm(g2.t(), x2).to(weight.dtype)
                else:  # accumulated by the GEMM itself (beta = 1): no second pass over the gradient
                    weight.grad.addmm_(g2.t(), x2)
            if linear.bias is not None and linear.bias.requires_grad:
                _accumulate(linear.bias, g2.sum(0))

    def pending(self) -> int:
        return len(self._records)

    def close(self) -> None:
        for linear in self._linears:
            linear.__dict__.pop("forward", None)
        self._records.clear()


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad += grad
