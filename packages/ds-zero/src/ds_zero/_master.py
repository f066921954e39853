"""Where the master weights live, as the optimizer step sees it: one part per kind, chosen once when
`ZeroOptimizer` is built (by its policy's ``master`` and whether ``ds_ops.adam_step`` computes its optimizer).

* `InPlace`: the optimizer steps the flat parameters themselves (float32 training, bf16 master weights, a
  16-bit model stepped directly at stage 0); clipping as ``torch.nn.utils.clip_grad_norm_`` does it.
* `WidenedMaster`: a float32 copy beside a 16-bit model, stepped by a non-Adam optimizer on float32 copies
  of the gradients; the 16-bit parameters follow it.
* `FusedDevice`: a float32 copy beside a 16-bit model, stepped by ``ds_ops.adam_step`` in one pass that also
  writes the 16-bit parameters (`_precision.fused_adam_step`).
* `HostMaster`: ZeRO-Offload: the copy on the host, stepped by ds-ops' CPU Adam (`_offload.HostOffload`).
* `ZenFlowMaster`: ZeRO-Offload's copy stepped by ZenFlow at its update boundaries (`_zenflow`).
* `NvmeMaster`: ZeRO-Infinity: Adam's states (and the copy) in files (`_offload.nvme_step`).

Each takes its tensors explicitly; ``step`` gets the loss scale and the clipping of this step.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ._offload import nvme_step
from ._precision import fused_adam_step


class MasterStep(Protocol):
    def step(self, optimizer: torch.optim.Optimizer, norm: torch.Tensor, global_norm: float, scale: float,
             clipping: float) -> None:
        """Step ``optimizer``: its gradients are times ``scale`` (fp16's loss scale); ``norm`` is their global
        norm (a tensor, scaled), ``global_norm`` the unscaled float; ``clipping`` the maximum norm (0: off)."""


def _coefficient(global_norm: float, clipping: float) -> float:
    return min(1.0, clipping / (global_norm + 1e-6)) if clipping > 0 else 1.0


class InPlace:
    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors

    def step(self, optimizer: torch.optim.Optimizer, norm: torch.Tensor, global_norm: float, scale: float,
             clipping: float) -> None:
        if clipping > 0:  # torch.nn.utils.clip_grad_norm_'s arithmetic, in float32
            coefficient = (clipping / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_([t.grad for t in self.tensors], coefficient)
        optimizer.step()


class WidenedMaster:
    """``tensors``: views of the float32 copy, whose ``.grad`` are float32 gradient buffers; ``grads``: the
    16-bit reduced gradients; ``copies``: the 16-bit parameters that follow."""

    def __init__(self, tensors: list[torch.Tensor], grads: list[torch.Tensor], copies: list[torch.Tensor]):
        self.tensors, self.grads, self.copies = tensors, grads, copies

    def step(self, optimizer: torch.optim.Optimizer, norm: torch.Tensor, global_norm: float, scale: float,
             clipping: float) -> None:
        multiplier = 1.0 / scale * _coefficient(global_norm, clipping)
        for tensor, grad in zip(self.tensors, self.grads, strict=True):
            tensor.grad.copy_(grad).mul_(multiplier)  # widened first, then scaled in float32
        optimizer.step()
        for copy, tensor in zip(self.copies, self.tensors, strict=True):
            copy.copy_(tensor.detach())


class FusedDevice:
    def __init__(self, recipe: Any, tensors: list[torch.Tensor], grads: list[torch.Tensor],
                 copies: list[torch.Tensor] | None):
        self.recipe, self.tensors, self.grads, self.copies = recipe, tensors, grads, copies

    def step(self, optimizer: torch.optim.Optimizer, norm: torch.Tensor, global_norm: float, scale: float,
             clipping: float) -> None:
        fused_adam_step(optimizer, self.recipe, self.tensors, self.grads, self.copies,
                        scale / _coefficient(global_norm, clipping))


class HostMaster:
    def __init__(self, host: Any, recipe: Any, tensors: list[torch.Tensor], grads: list[torch.Tensor],
                 copies: list[torch.Tensor] | None):
        self.host, self.recipe, self.tensors, self.grads, self.copies = host, recipe, tensors, grads, copies

    def step(self, optimizer: torch.optim.Optimizer, norm: torch.Tensor, global_norm: float, scale: float,
             clipping: float) -> None:
        self.host.adam_step(optimizer, self.recipe, self.tensors, self.grads, self.copies,
                            scale / _coefficient(global_norm, clipping))


class ZenFlowMaster:
    """ZeRO-Offload's CPU copy stepped by ZenFlow at its update boundaries (`_zenflow.ZenFlow.full_step`: at once,
    or in the background with one update's lag); the model's parameters are uploaded when it wrote them."""

    def __init__(self, zenflow: Any, host: Any, recipe: Any, tensors: list[torch.Tensor], grads: list[torch.Tensor],
                 copies: list[torch.Tensor] | None):
        self.zenflow, self.host, self.recipe = zenflow, host, recipe
        self.tensors, self.grads, self.copies = tensors, grads, copies

    def step(self, optimizer: torch.optim.Optimizer, norm: torch.Tensor, global_norm: float, scale: float,
             clipping: float) -> None:
        if self.zenflow.full_step(optimizer, self.recipe, self.tensors, self.grads, self.copies,
                                  scale / _coefficient(global_norm, clipping)):
            self.host.upload()


class NvmeMaster:
    def __init__(self, host: Any, nvme: Any, recipe: Any, tensors: list[torch.Tensor]):
        self.host, self.nvme, self.recipe, self.tensors = host, nvme, recipe, tensors

    def step(self, optimizer: torch.optim.Optimizer, norm: torch.Tensor, global_norm: float, scale: float,
             clipping: float) -> None:
        nvme_step(optimizer, self.tensors, self.host, self.nvme, self.recipe, scale / _coefficient(global_norm, clipping))


def master_step(*, recipe: Any, nvme: Any, host: Any, tensors: list[torch.Tensor], grads: list[torch.Tensor],
                host_grads: list[torch.Tensor], host_copies: list[torch.Tensor] | None,
                copies: list[torch.Tensor] | None, master_grads: torch.Tensor | None, zenflow: Any = None) -> MasterStep:
    """The part that steps this run's master weights: fused Adam (``recipe``) on NVMe, by ZenFlow (``zenflow``,
    on the host), on the host or on the device; else a float32 copy with widened gradients (``master_grads``), or
    the parameters in place."""
    if recipe is not None:
        if nvme is not None:
            return NvmeMaster(host, nvme, recipe, tensors)
        if zenflow is not None:
            return ZenFlowMaster(zenflow, host, recipe, tensors, host_grads, host_copies)
        if host is not None:
            return HostMaster(host, recipe, tensors, host_grads, host_copies)
        return FusedDevice(recipe, tensors, grads, copies)
    if master_grads is not None:
        return WidenedMaster(tensors, grads, copies)
    return InPlace(tensors)


def step_grad_views(tensors: list[torch.Tensor], grads: list[torch.Tensor], in_master: list[tuple[int, int]],
                    master_grads: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, its ``.grad``) for each tensor the optimizer steps: its slice of the float32 gradient buffer of a
    non-Adam optimizer over a 16-bit model (``master_grads``, laid out as the master copy: ``in_master``), else
    its reduced gradients ``grads`` where they have its dtype and device (a float32 master's fused step reads
    16-bit gradients where they are, without a ``.grad``)."""
    out = []
    for tensor, grad, (at, n) in zip(tensors, grads, in_master, strict=True):
        if master_grads is not None:
            out.append((tensor, master_grads[at:at + n]))
        elif grad.dtype == tensor.dtype and grad.device == tensor.device:
            out.append((tensor, grad))
    return out
