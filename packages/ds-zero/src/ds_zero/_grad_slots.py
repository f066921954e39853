"""Where each trained parameter's gradient must be for ZeRO to see it, whatever the training loop does to
``.grad`` (issue 41: ``module.zero_grad()`` before ``engine.backward`` made every step a silent no-op).

At stages 0-1 each parameter's ``.grad`` is a view of ZeRO's flat gradient buffer, so backward accumulates
straight into the buffer that is reduced and stepped. User code may break that link: ``zero_grad()`` of the
module or of a torch optimizer (``set_to_none=True``, PyTorch's default), ``p.grad = None``, ``p.grad =
p.grad.clamp(...)``; autograd then puts the next gradient in a fresh tensor the buffer never sees. `GradientSlots`
restores the link with PyTorch's meaning: whatever ``.grad`` holds is the gradient. When a gradient arrives
(`adopt`) or a bucket is reduced (`sync`), a ``.grad`` that is not the parameter's view is copied into the view
(a None one, never given a gradient since, counts as zeros) and ``.grad`` points at the view again.

At stages 2-3 a parameter's ``.grad`` is reduced into this rank's partition as soon as backward makes it and
then freed, so a later ``zero_grad()`` cannot take it back. A backward run by another `ZeroOptimizer` (the GAN's
generator loss flowing through the discriminator) therefore leaves the gradients in ``.grad`` (`hold`): if the
user clears them before the discriminator's next backward they are gone, as in PyTorch; otherwise they are
reduced with that backward, or at the step.

`check_at_step` refuses what ZeRO cannot honour, naming it, rather than stepping something else silently: a
gradient cleared or replaced after its reduction (stage 1: and changed in place: the step uses the shard reduced
during backward), a ``.grad`` assigned at stages 2-3 after backward, a model parameter that is not the one ZeRO
trains but got a gradient (a ``Parameter`` replaced after ZeRO took the model).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from ._model import param_name

if TYPE_CHECKING:
    from ._policy import ZeroPolicy

logger = logging.getLogger(__name__)

# the ZeroOptimizers whose backward() is running, innermost last (a backward may start another's: rare)
_RUNNING: list[object] = []


class _Layout(Protocol):
    """What `GradientSlots` needs of a `FlatLayout`: where each parameter sits in the flat buffer."""

    slots: list


class GradientSlots:
    """The link between each trained parameter's ``.grad`` and ZeRO's buffers (see the module docstring).
    ``grads``: the flat gradient buffer of stages 0-1 (None at stages 2-3)."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], layout: _Layout, policy: ZeroPolicy,
                 grads: torch.Tensor | None):
        self.model, self.params, self.stage = model, params, policy.stage  # (stage: for messages)
        self._whole_grads = policy.whole_grads  # stages 0-1: every .grad a view of ``grads``
        self._stage1 = policy.reduces_whole_accumulation
        self.views: list[torch.Tensor] = []
        if grads is not None:
            self.views = [grads[slot.offset:slot.offset + slot.numel].view(p.shape)
                          for p, slot in zip(params, layout.slots, strict=True)]
            for p, view in zip(params, self.views, strict=True):
                p.grad = view
        self._grads = grads
        self.delivered: set[int] = set()  # stages 0-1: parameters whose gradient reached the buffer since the step
        self.held: set[int] = set()  # stages 2-3: gradients another optimizer's backward left in .grad
        self._version: int | None = None  # stage 1: the buffer's version once a boundary's reductions landed
        self._known = {id(p) for p in model.parameters()}
        self._warned_strays = self._warned_skip = False

    # ------------------------------------------------------------------------------ during backward
    @staticmethod
    def running(optimizer: object):
        """A context marking ``optimizer``'s backward as running (see `foreign`)."""
        class _Running:
            def __enter__(self):
                _RUNNING.append(optimizer)

            def __exit__(self, *exc):
                _RUNNING.remove(optimizer)
        return _Running()

    @staticmethod
    def foreign(optimizer: object) -> bool:
        """Whether the backward running now is another `ZeroOptimizer`'s (not ``optimizer``'s, nor a plain
        ``loss.backward()``)."""
        return bool(_RUNNING) and _RUNNING[-1] is not optimizer

    def adopt(self, index: int) -> None:
        """Stages 0-1, a gradient arrived: into the parameter's view, if autograd put it elsewhere."""
        self._into_view(index, zero_if_none=False)
        self.delivered.add(index)

    def sync(self, indices) -> None:
        """Stages 0-1, before a reduction: every parameter's ``.grad`` is its view (a replaced one copied in,
        a cleared one zeros)."""
        for index in indices:
            self._into_view(index, zero_if_none=True)

    def _into_view(self, index: int, zero_if_none: bool) -> None:
        param, view = self.params[index], self.views[index]
        grad = param.grad
        if grad is view:
            return
        if grad is None:
            if not zero_if_none:
                return
            view.zero_()
        else:
            if grad.data_ptr() != view.data_ptr() or grad.stride() != view.stride():
                view.copy_(grad)
            self.delivered.add(index)
        param.grad = view

    def point_at_views(self) -> None:
        """Stages 0-1, the buffer zeroed: every ``.grad`` its view again, whatever the user left there."""
        for param, view in zip(self.params, self.views, strict=True):
            if param.grad is not view:
                param.grad = view

    def hold(self, index: int) -> None:
        """Stages 2-3: another optimizer's backward made this gradient; it stays in ``.grad`` for now."""
        self.held.add(index)

    def take_held(self) -> list[int]:
        """Stages 2-3, at the step: the held gradients the user did not clear (to be reduced now)."""
        pending = sorted(i for i in self.held if self.params[i].grad is not None)
        self.held.clear()
        return pending

    def reduced(self, index: int) -> None:
        """Stages 2-3: this parameter's gradient went into the partition (held no more)."""
        self.held.discard(index)

    def boundary_landed(self) -> None:
        """Stage 1: the boundary's reductions landed; later in-place changes to ``.grad`` would be lost."""
        if self._stage1:
            self._version = self._grads._version

    # ------------------------------------------------------------------------------ at the step
    def check_at_step(self) -> None:
        """Before the optimizer steps (the reductions landed): refuse what the step would not honour."""
        if self._whole_grads:
            self._check_views()
        else:
            for index, param in enumerate(self.params):
                if param.grad is not None:
                    raise RuntimeError(
                        f"ZeroOptimizer.step: parameter {self._name(index)} has a .grad that never reached ZeRO: at "
                        f"stage {self.stage} gradients are reduced into this rank's partition as backward makes "
                        "them, so a .grad assigned after backward would be ignored; set it with "
                        "ds_zero.safe_set_full_grad(param, value) instead")
        self._version = None
        self.delivered.clear()
        self._warn_strays()

    def _check_views(self) -> None:
        for index, (param, view) in enumerate(zip(self.params, self.views, strict=True)):
            grad = param.grad
            if grad is view:
                continue
            if grad is None:
                if index in self.delivered:
                    raise RuntimeError(
                        f"ZeroOptimizer.step: the gradient of {self._name(index)} was cleared (.grad = None, "
                        "zero_grad()) after the backward that made it and before step(); ZeRO has reduced it "
                        "already and steps flat buffers, where one parameter cannot be skipped. Clear gradients "
                        "before the forward (or call engine.zero_grad()), or freeze the parameter "
                        "(requires_grad=False) before the backward")
                if not self._warned_skip:
                    self._warned_skip = True
                    logger.warning("ZeroOptimizer.step: %s has no gradient (.grad is None: cleared, and no backward "
                                   "reached it since); ZeRO steps it with a zero gradient (Adam's moments still move "
                                   "it, as in DeepSpeed's ZeRO) where a torch optimizer would skip it. Freeze it with "
                                   "requires_grad=False before ZeRO is built to keep it fixed", self._name(index))
                param.grad = view  # no gradient since the step: zeros, as the buffer holds
                continue
            if self._stage1:
                raise RuntimeError(self._stage1_change(index, "replaced"))
            self.sync([index])  # stage 0: the buffer holds the averaged gradients; the user's tensor replaces them
        if self._version is not None and self._grads._version != self._version:
            raise RuntimeError(self._stage1_change(None, "changed in place"))

    def _stage1_change(self, index: int | None, how: str) -> str:
        what = f"the .grad of {self._name(index)} was {how}" if index is not None else \
            f"the gradients (.grad) were {how}"
        return (f"ZeroOptimizer.step: {what} between backward and step() (torch.nn.utils.clip_grad_norm_?); at "
                "ZeRO stage 1 the step uses this rank's shard of the averaged gradients, reduced during backward, "
                "and .grad holds this rank's local gradients, so the change would be ignored (DeepSpeed ignores it "
                "silently). Clip with the config's gradient_clipping, change gradients with "
                "ds_zero.safe_set_full_grad, or use stage 0")

    def _warn_strays(self) -> None:
        if self._warned_strays:
            return
        strays = [name for name, p in self.model.named_parameters() if p.grad is not None and id(p) not in self._known]
        if strays:
            self._warned_strays = True
            logger.warning("ZeroOptimizer.step: %s of the model got gradients but %s not trained by ZeRO: %s "
                           "replaced (a new nn.Parameter) or added after ZeRO took the model, so %s gradients "
                           "never reach the step. Replace a parameter's values with p.data.copy_(...), or build "
                           "the engine after the model is complete", ", ".join(strays[:5]) +
                           (f" and {len(strays) - 5} more" if len(strays) > 5 else ""),
                           "is" if len(strays) == 1 else "are", "it was" if len(strays) == 1 else "they were",
                           "its" if len(strays) == 1 else "their")

    def _name(self, index: int) -> str:
        return param_name(self.model, self.params[index])
