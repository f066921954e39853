"""DeepSpeed's loss-scaler objects (``deepspeed.runtime.fp16.loss_scaler``) for code that drives one by hand:
`LossScaler` (a static scale), `DynamicLossScaler` (DeepSpeed 0.19.8's window / hysteresis / floor rules,
with its attribute names) and `CreateLossScaler`, the factory DeepSpeed's optimizers call.

`ZeroOptimizer` keeps its own scaler (configured by the ``fp16`` section); these classes are the ones a
DeepSpeed script or a port of DeepSpeed's FP16 optimizers constructs itself.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch

import ds_comm

logger = logging.getLogger(__name__)

# DeepSpeed's keys of ``dynamic_loss_args`` (what ``fp16`` config sections become)
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"
_DYNAMIC_ARGUMENTS = (INITIAL_LOSS_SCALE, SCALE_WINDOW, MIN_LOSS_SCALE, DELAYED_SHIFT, CONSECUTIVE_HYSTERESIS)


def _on_rank_zero() -> bool:
    return not ds_comm.is_initialized() or ds_comm.get_rank() == 0


def _scale_value(owner: str, name: str, value: Any, *, minimum: float, inclusive: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (value == minimum and not inclusive):
        bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
        raise ValueError(f"{owner}: {name} must be a finite number {bound}, got {value!r}")
    return value


def _count(owner: str, name: str, value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be an integer >= 1, got {value!r}")
    return value


def _flag(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {name} must be true or false, got {value!r}")
    return value


def _has_inf_or_nan(tensor: torch.Tensor) -> bool:
    if tensor.is_sparse:
        tensor = tensor.coalesce().values()
    return tensor.numel() > 0 and not bool(torch.isfinite(tensor).all())


class LossScalerBase:
    """What both scalers share: ``cur_scale`` (``loss_scale``), scaling a loss and running its backward."""

    def __init__(self, cur_scale: float) -> None:
        self.cur_scale = _scale_value(type(self).__name__, "the loss scale", cur_scale, minimum=0.0, inclusive=False)
        self.dynamic = False

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module: Any, grad_in: tuple, grad_out: Any) -> tuple:
        """A backward hook's result: every gradient of ``grad_in`` times the loss scale (None stays None)."""
        return tuple(None if grad is None else self.loss_scale * grad for grad in grad_in)

    def update_scale(self, overflow: bool) -> None:
        if overflow and _on_rank_zero():
            logger.warning("[deepspeed] OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated.")

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale, without running backward."""
        return loss * self.loss_scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self.scale_loss(loss).backward(retain_graph=retain_graph)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cur_scale={self.cur_scale!r})"


class LossScaler(LossScalerBase):
    """A static loss scale (DeepSpeed's ``LossScaler(scale=1)``): never changes, never sees an overflow."""

    def __init__(self, scale: float = 1) -> None:
        super().__init__(scale)

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        return False

    def has_overflow_serial(self, params: Iterable[torch.Tensor]) -> bool:
        return False

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return False


class DynamicLossScaler(LossScalerBase):
    """DeepSpeed's dynamic loss scale.

    After each step call ``update_scale(overflow)``. An overflow with hysteresis left (``cur_hysteresis``
    above 1 and ``delayed_shift`` above 1) uses one unit of it; otherwise the scale is divided by
    ``scale_factor`` (2), never below ``min_scale`` (an overflow already at ``min_scale`` raises a
    RuntimeError when ``raise_error_at_min_scale``). A step without overflow raises the scale by
    ``scale_factor`` when the clean steps before it since the last overflow (or the start) are a positive
    multiple of ``scale_window``, and refills the hysteresis then; with ``consecutive_hysteresis`` the
    hysteresis is refilled by every step without overflow. ``cur_iter`` counts the updates,
    ``last_overflow_iter`` is the iteration of the last overflow (-1: none yet).
    """

    def __init__(self, init_scale: float, scale_window: int, min_scale: float, delayed_shift: int,
                 consecutive_hysteresis: bool, raise_error_at_min_scale: bool = True,
                 dtype: torch.dtype = torch.half) -> None:
        super().__init__(init_scale)
        owner = "DynamicLossScaler"
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = _count(owner, "scale_window", scale_window)
        self.min_scale = _scale_value(owner, "min_scale", min_scale, minimum=0.0, inclusive=True)
        self.delayed_shift = _count(owner, "delayed_shift", delayed_shift)
        self.cur_hysteresis = self.delayed_shift
        self.consecutive_hysteresis = _flag(owner, "consecutive_hysteresis", consecutive_hysteresis)
        self.raise_error_at_min_scale = _flag(owner, "raise_error_at_min_scale", raise_error_at_min_scale)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{owner}: dtype must be a torch.dtype, got {dtype!r}")
        self.dynamic = True
        self.dtype = dtype

    def has_overflow_serial(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether any parameter's gradient holds an inf or NaN (on this rank only)."""
        return any(p.grad is not None and _has_inf_or_nan(p.grad) for p in params)

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """`has_overflow_serial`: this rank's gradients; reduce the answer across ranks yourself."""
        return self.has_overflow_serial(params)

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return _has_inf_or_nan(x)

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise RuntimeError(f"DynamicLossScaler: gradient overflow with the loss scale already at its "
                                       f"minimum ({self.min_scale:g}); it cannot be lowered further")
                lowered = max(self.cur_scale / self.scale_factor, self.min_scale)
                if _on_rank_zero():
                    logger.info("[deepspeed] OVERFLOW! Skipping step. Attempted loss scale: %g, reducing to %g",
                                self.cur_scale, lowered)
                self.cur_scale = lowered
            else:
                if _on_rank_zero():
                    logger.info("[deepspeed] OVERFLOW! Skipping step. Attempted loss scale: %g, but hysteresis is "
                                "%d. Reducing hysteresis to %d", self.cur_scale, self.cur_hysteresis,
                                self.cur_hysteresis - 1)
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            clean_before = self.cur_iter - self.last_overflow_iter - 1
            if clean_before > 0 and clean_before % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(cur_scale={self.cur_scale!r}, cur_iter={self.cur_iter}, "
                f"last_overflow_iter={self.last_overflow_iter}, cur_hysteresis={self.cur_hysteresis})")


def CreateLossScaler(dtype: torch.dtype, static_loss_scale: float, dynamic_scaling: bool,
                     dynamic_loss_args: dict[str, Any] | None) -> LossScalerBase:
    """DeepSpeed's factory: a `DynamicLossScaler` from ``dynamic_loss_args`` (keys ``init_scale``,
    ``scale_window``, ``min_scale``, ``delayed_shift``, ``consecutive_hysteresis``, optionally
    ``raise_error_at_min_scale``) for float16 with ``dynamic_scaling``; else a static `LossScaler` of
    ``static_loss_scale`` for float16 and of 1 for any other dtype (nothing to scale)."""
    if dtype == torch.half and dynamic_scaling:
        if not isinstance(dynamic_loss_args, dict):
            raise ValueError("CreateLossScaler: dynamic float16 loss scaling needs dynamic_loss_args, a dict with "
                             f"{', '.join(_DYNAMIC_ARGUMENTS)}; got {dynamic_loss_args!r}")
        allowed = (*_DYNAMIC_ARGUMENTS, "raise_error_at_min_scale")
        unknown = sorted(set(dynamic_loss_args) - set(allowed))
        missing = [key for key in _DYNAMIC_ARGUMENTS if key not in dynamic_loss_args]
        if unknown or missing:
            raise ValueError(f"CreateLossScaler: dynamic_loss_args has unknown keys {unknown} and lacks {missing}; "
                             f"allowed: {', '.join(allowed)}")
        return DynamicLossScaler(dtype=dtype, **dynamic_loss_args)
    return LossScaler(scale=static_loss_scale if dtype == torch.half else 1.0)
