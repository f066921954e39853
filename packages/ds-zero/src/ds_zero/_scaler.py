"""Loss scaling for fp16: DeepSpeed's dynamic rules (window, hysteresis, floor) and static scaling."""

from __future__ import annotations

import logging

from .config import FP16Config

logger = logging.getLogger(__name__)


class LossScaler:
    """The scale a fp16 loss is multiplied by before backward, and its update after each step.

    Dynamic (``fp16.loss_scale == 0``): starts at ``2**initial_scale_power``; an overflow uses up one
    unit of ``hysteresis`` and, when none is left, halves the scale (never below ``min_loss_scale``;
    an overflow at the floor is an error, as in DeepSpeed); after every ``loss_scale_window`` steps
    without an overflow since the last one (DeepSpeed 0.19's count: the steps before the current
    one) the scale doubles and the hysteresis is refilled
    (``consecutive_hysteresis``: refilled after every step without overflow). Static: the scale never
    changes and an overflow only skips the step.
    """

    def __init__(self, config: FP16Config):
        self.dynamic = config.dynamic
        self.scale = float(2 ** config.initial_scale_power) if self.dynamic else float(config.loss_scale)
        self.window = config.loss_scale_window
        self.min_scale = config.min_loss_scale
        self.hysteresis = config.hysteresis
        self.consecutive_hysteresis = config.consecutive_hysteresis
        self.hysteresis_left = config.hysteresis
        self.step = 0
        self.last_overflow_step = -1

    def update(self, overflow: bool) -> None:
        """Account for one optimizer step that did (``overflow``) or did not see an inf/nan gradient."""
        if not self.dynamic:
            self.step += 1
            return
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                if self.scale == self.min_scale:
                    raise RuntimeError(f"fp16: gradient overflow at the minimum loss scale {self.min_scale:g} "
                                       "(fp16.min_loss_scale); the loss or gradients are inf/nan at any scale")
                self.scale = max(self.scale / 2, self.min_scale)
                logger.info("fp16 overflow: loss scale lowered to %g", self.scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_step = self.step
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            stable = self.step - self.last_overflow_step - 1  # clean steps before this one
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= 2
        self.step += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "step": self.step, "last_overflow_step": self.last_overflow_step,
                "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        missing = {"scale", "step", "last_overflow_step", "hysteresis_left"} - set(state)
        if missing:
            raise ValueError(f"loss scaler state lacks {sorted(missing)}")
        self.scale, self.step = float(state["scale"]), int(state["step"])
        self.last_overflow_step, self.hysteresis_left = int(state["last_overflow_step"]), int(state["hysteresis_left"])
