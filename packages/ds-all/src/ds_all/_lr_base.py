"""What every learning-rate schedule of ``ds_all.lr_schedules`` shares: the optimizer it drives, the
iteration counter, writing the rates into the param groups, and the checks of its arguments."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

WARMUP_TYPES = ("log", "linear")


def torch_optimizer(optimizer: Any, owner: str) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` to drive: the argument itself, or the one a wrapper holds as
    ``.optimizer`` (as DeepSpeed's schedules accept)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise ValueError(f"{owner}: optimizer must be a torch.optim.Optimizer or hold one as .optimizer, "
                     f"got {type(optimizer).__name__}")


def integer(owner: str, name: str, value: Any, *, minimum: int) -> int:
    """An integer count (``1e3`` and ``1000.0`` are accepted as 1000) that is at least ``minimum``."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def number(owner: str, name: str, value: Any, *, minimum: float | None = None,
           maximum: float | None = None) -> float:
    """A finite real number, within ``[minimum, maximum]`` where they are given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be a finite number, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "-inf" if minimum is None else minimum
        high = "inf" if maximum is None else maximum
        raise ValueError(f"{owner}: {name} must be in [{low}, {high}], got {value!r}")
    return float(value)


def per_group(owner: str, name: str, value: Any, groups: int, *, minimum: float = 0.0) -> list[float]:
    """One non-negative value per param group: a list/tuple of that length, or one number for all."""
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{owner}: {name} must be one number or a list of one per param group "
                             f"({groups}), got a list of {len(value)}")
        return [number(owner, f"{name}[{i}]", v, minimum=minimum) for i, v in enumerate(value)]
    return [number(owner, name, value, minimum=minimum)] * groups


def ordered(owner: str, low_name: str, lows: Sequence[float], high_name: str, highs: Sequence[float]) -> None:
    for i, (low, high) in enumerate(zip(lows, highs, strict=True)):
        if low > high:
            where = f" (param group {i})" if len(lows) > 1 else ""
            raise ValueError(f"{owner}: {low_name} ({low}) must be <= {high_name} ({high}){where}")


def warmup_type(owner: str, value: Any) -> str:
    """``value`` when it is "log" or "linear"; anything else falls back to "log" with a warning, as in
    DeepSpeed."""
    if isinstance(value, str) and value in WARMUP_TYPES:
        return value
    logger.warning("%s: unknown warmup_type %r (allowed: 'log', 'linear'); using 'log' instead, as DeepSpeed does",
                   owner, value)
    return "log"


def warmup_fraction(kind: str, iteration: int, steps: int) -> float:
    """How far the warmup has come after ``iteration`` (0-based, ``< steps``): ``log`` rises as
    ln(iteration + 1) / ln(steps), ``linear`` as iteration / steps."""
    if kind == "log":
        return math.log(iteration + 1) / math.log(steps)
    return iteration / steps


class Schedule:
    """The base of the schedules: ``last_batch_iteration`` counts the ``step()`` calls (-1 before the
    first); subclasses say what the rate of each group is at an iteration (``get_lr``) and may move the
    momentum with it (``_apply_momentum``). Constructed with ``last_batch_iteration=-1`` a schedule writes
    its starting rates into the optimizer; constructed to resume (any other value) it leaves the optimizer
    as it is until the next ``step()``."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        owner = type(self).__name__
        self.optimizer = torch_optimizer(optimizer, owner)
        self.last_batch_iteration = integer(owner, "last_batch_iteration", last_batch_iteration, minimum=-1)
        self._last_lr: list[float] | None = None

    def _start(self) -> None:
        """Called at the end of a subclass's __init__, once its parameters are set."""
        if self.last_batch_iteration == -1:
            self._apply()

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply_momentum(self) -> None:
        """Subclasses that schedule momentum write it here."""

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # a tensor learning rate stays a tensor (capturable optimizers)
            else:
                group["lr"] = lr
        self._apply_momentum()
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def _advance(self, iteration: int | None) -> None:
        if iteration is None:
            iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = integer(type(self).__name__, "the iteration given to step()", iteration,
                                            minimum=0)
        self._apply()

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one iteration (or jump to ``last_batch_iteration``) and set the optimizer's rates."""
        self._advance(last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The rates the schedule last wrote into the optimizer, one per param group."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}: no learning rate set yet; a schedule constructed to "
                               "resume (last_batch_iteration >= 0) sets one at its first step()")
        return list(self._last_lr)

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or "last_batch_iteration" not in state_dict:
            raise ValueError(f"{type(self).__name__}.load_state_dict: expected a dict with "
                             f"'last_batch_iteration', got {state_dict!r}")
        self.last_batch_iteration = integer(type(self).__name__, "last_batch_iteration",
                                            state_dict["last_batch_iteration"], minimum=-1)
