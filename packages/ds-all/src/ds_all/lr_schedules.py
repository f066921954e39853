"""DeepSpeed's learning-rate schedules, by the names, arguments and defaults of its ``scheduler`` section.

Every schedule takes the optimizer first and ``last_batch_iteration=-1`` last, counts ``step()`` calls
(call it after each ``optimizer.step()``), and offers ``get_lr()``, ``get_last_lr()``, ``state_dict()`` and
``load_state_dict()``. The rates follow DeepSpeed's formulas; the arguments are checked where DeepSpeed
would accept nonsense (see "Differences from DeepSpeed" in the README).

* `WarmupLR`: from ``warmup_min_lr`` up to ``warmup_max_lr`` over ``warmup_num_steps``, then constant.
* `WarmupDecayLR`: the same warmup, then linearly back down to ``warmup_min_lr`` at ``total_num_steps``.
* `WarmupCosineLR`: a warmup of the optimizer's own rate from ``warmup_min_ratio`` of it, then a cosine
  down to ``cos_min_ratio`` of it at ``total_num_steps``.
* `OneCycle`: the 1-cycle policy (rate up then down, momentum the other way), then a decay.
* `LRRangeTest`: a rate that grows without bound, to find the largest one that still trains.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ._lr_base import Schedule, integer, number, ordered, per_group, warmup_fraction
from ._lr_base import warmup_type as check_warmup_type

logger = logging.getLogger(__name__)

# DeepSpeed's module constants: the schedules' names and their keys in the ``scheduler.params`` section
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

__all__ = ["COS_MIN_RATIO", "CYCLE_FIRST_STAIR_COUNT", "CYCLE_FIRST_STEP_SIZE", "CYCLE_MAX_LR", "CYCLE_MAX_MOM",
           "CYCLE_MIN_LR", "CYCLE_MIN_MOM", "CYCLE_SECOND_STAIR_COUNT", "CYCLE_SECOND_STEP_SIZE", "DECAY_LR_RATE",
           "DECAY_MOM_RATE", "DECAY_STEP_SIZE", "EDGE_VALUE", "LR_RANGE_TEST", "LR_RANGE_TEST_MIN_LR",
           "LR_RANGE_TEST_STAIRCASE", "LR_RANGE_TEST_STEP_RATE", "LR_RANGE_TEST_STEP_SIZE", "LR_SCHEDULE", "MID_VALUE",
           "ONE_CYCLE", "TOTAL_NUM_STEPS", "VALID_LR_SCHEDULES", "WARMUP_COSINE_LR", "WARMUP_DECAY_LR", "WARMUP_LINEAR_RATE",
           "WARMUP_LOG_RATE", "WARMUP_LR", "WARMUP_MAX_LR", "WARMUP_MIN_LR", "WARMUP_MIN_RATIO", "WARMUP_NUM_STEPS",
           "WARMUP_TYPE", "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]


def _warn_short_total(owner: str, total: int, warmup: int, floor: str) -> None:
    if total < warmup:
        logger.warning("%s: total_num_steps (%d) is less than warmup_num_steps (%d, which is at least 2); the "
                       "rate goes to %s right after the warmup, as in DeepSpeed", owner, total, warmup, floor)


class WarmupLR(Schedule):
    """The rate of each group rises from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``
    iterations (``warmup_type`` "log": by ln(i + 1) / ln(steps); "linear": by i / steps), then stays there.

    ``warmup_max_lr=None`` means each group's rate as the optimizer has it. ``warmup_num_steps`` below 2
    counts as 2 (1 as in DeepSpeed; 0, which DeepSpeed refuses, too). An unknown ``warmup_type`` is "log",
    with a warning, as in DeepSpeed. At construction the rate is ``warmup_min_lr``, and it still is after the
    first ``step()`` (iteration 0).
    """

    def __init__(self, optimizer: Any, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self._set_warmup(warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)
        self._start()

    def _set_warmup(self, warmup_min_lr, warmup_max_lr, warmup_num_steps, kind) -> None:
        owner, groups = type(self).__name__, self.optimizer.param_groups
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in groups]
        self.min_lrs = per_group(owner, "warmup_min_lr", warmup_min_lr, len(groups))
        self.max_lrs = per_group(owner, "warmup_max_lr", warmup_max_lr, len(groups))
        ordered(owner, "warmup_min_lr", self.min_lrs, "warmup_max_lr", self.max_lrs)
        self.warmup_num_steps = max(2, integer(owner, "warmup_num_steps", warmup_num_steps, minimum=0))
        self.warmup_type = check_warmup_type(owner, kind)

    def _gamma(self) -> float:
        """The fraction of the way from the minimum to the maximum rate at the current iteration."""
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            return warmup_fraction(self.warmup_type, i, self.warmup_num_steps)
        return self._after_warmup(i)

    def _after_warmup(self, i: int) -> float:
        return 1.0

    def get_lr(self) -> list[float]:
        gamma = self._gamma()
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """`WarmupLR`'s warmup, then a linear decay of the rate from ``warmup_max_lr`` back to
    ``warmup_min_lr`` at iteration ``total_num_steps`` (and ``warmup_min_lr`` after it). A
    ``total_num_steps`` below ``warmup_num_steps`` is accepted with a warning, as in DeepSpeed: the rate
    then drops to ``warmup_min_lr`` right after the warmup."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        Schedule.__init__(self, optimizer, last_batch_iteration)
        self._set_warmup(warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)
        self.total_num_steps = integer("WarmupDecayLR", "total_num_steps", total_num_steps, minimum=1)
        _warn_short_total("WarmupDecayLR", self.total_num_steps, self.warmup_num_steps, "warmup_min_lr")
        self._start()

    def _after_warmup(self, i: int) -> float:
        return max(0.0, (self.total_num_steps - i) / max(1, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(Schedule):
    """Each group's own rate (as the optimizer has it at construction) times a ratio: the ratio rises
    from ``warmup_min_ratio`` to 1 over ``warmup_num_steps`` (``warmup_type`` as in `WarmupLR`), then
    follows a half cosine down to ``cos_min_ratio`` at iteration ``total_num_steps`` and stays there.
    At construction the rate is ``warmup_min_ratio`` times the group's rate. With ``total_num_steps`` at
    or below ``warmup_num_steps`` (below: with a warning) the ratio drops to ``cos_min_ratio`` right after
    the warmup, as in DeepSpeed."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        owner = "WarmupCosineLR"
        self.warmup_min_ratio = number(owner, "warmup_min_ratio", warmup_min_ratio, minimum=0.0, maximum=1.0)
        self.cos_min_ratio = number(owner, "cos_min_ratio", cos_min_ratio, minimum=0.0, maximum=1.0)
        self.warmup_num_steps = max(2, integer(owner, "warmup_num_steps", warmup_num_steps, minimum=0))
        self.warmup_type = check_warmup_type(owner, warmup_type)
        self.total_num_steps = integer(owner, "total_num_steps", total_num_steps, minimum=1)
        _warn_short_total(owner, self.total_num_steps, self.warmup_num_steps, "cos_min_ratio")
        self.base_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        """The factor applied to every group's base rate at the current iteration."""
        i = self.last_batch_iteration
        if i < 0:
            return self.warmup_min_ratio
        if i < self.warmup_num_steps:
            fraction = warmup_fraction(self.warmup_type, i, self.warmup_num_steps)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * fraction
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)  # 1: no decay window (DeepSpeed's)
        progress = min(1.0, (i - self.warmup_num_steps + 1) / decay_steps)
        return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1.0 + math.cos(math.pi * progress)) / 2

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.base_lrs]


class LRRangeTest(Schedule):
    """The rate grows from ``lr_range_test_min_lr``: after iteration i it is
    ``min_lr * (1 + lr_range_test_step_rate * (i + 1) / lr_range_test_step_size)``, the quotient rounded
    down when ``lr_range_test_staircase`` (the rate then changes once every ``step_size`` iterations).
    At construction it is ``min_lr``."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: float | list[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        owner = "LRRangeTest"
        self.min_lr = per_group(owner, "lr_range_test_min_lr", lr_range_test_min_lr,
                                len(self.optimizer.param_groups))
        self.step_size = integer(owner, "lr_range_test_step_size", lr_range_test_step_size, minimum=1)
        self.step_rate = number(owner, "lr_range_test_step_rate", lr_range_test_step_rate, minimum=0.0)
        if not isinstance(lr_range_test_staircase, bool):
            raise ValueError(f"LRRangeTest: lr_range_test_staircase must be true or false, "
                             f"got {lr_range_test_staircase!r}")
        self.staircase = lr_range_test_staircase
        self._start()

    def get_lr(self) -> list[float]:
        done = self.last_batch_iteration + 1
        interval = done // self.step_size if self.staircase else done / self.step_size
        return [low * (1 + self.step_rate * interval) for low in self.min_lr]

    def step(self, batch_iteration: int | None = None) -> None:
        """Advance one iteration (or jump to ``batch_iteration``) and set the optimizer's rates."""
        self._advance(batch_iteration)


class OneCycle(Schedule):
    """The 1-cycle policy: over ``cycle_first_step_size`` iterations the rate rises linearly from
    ``cycle_min_lr`` to ``cycle_max_lr``, over ``cycle_second_step_size`` (default: the first; 0: none, the
    rate is back at ``cycle_min_lr`` at the cycle's last iteration, as in DeepSpeed) it falls back; after the
    cycle it is ``cycle_min_lr / (1 + decay_lr_rate * n / decay_step_size)`` at the n-th iteration past it
    (no decay when ``decay_step_size`` is 0; a decay rate is then ignored with a warning, as DeepSpeed ignores
    it).

    With ``cycle_momentum`` the momentum moves the other way between ``cycle_max_mom`` and ``cycle_min_mom``
    and is ``cycle_max_mom * (1 + decay_mom_rate * n / decay_step_size)`` after the cycle. As in DeepSpeed,
    it is written as ``betas = (momentum, 0.99)`` (beta2 replaced by 0.99, with one warning when a group had
    another) and only for optimizers whose defaults have ``betas``; others (SGD's ``momentum``) get a warning
    and no momentum cycling.

    Rates and momenta are one number or a list with one per param group. ``cycle_first_stair_count`` /
    ``cycle_second_stair_count`` (0: off; the second defaults to the first) make each half a staircase of
    that many equal steps instead of a ramp (DeepSpeed's floor of the position in the half). At
    construction the rate is ``cycle_min_lr`` and the momentum ``cycle_min_mom``, as DeepSpeed sets them.
    """

    def __init__(self, optimizer: Any, cycle_min_lr: float | list[float], cycle_max_lr: float | list[float],
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float | list[float] = 0.8,
                 cycle_max_mom: float | list[float] = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        owner, groups = "OneCycle", self.optimizer.param_groups
        self.first_size = integer(owner, "cycle_first_step_size", cycle_first_step_size, minimum=1)
        self.second_size = (self.first_size if cycle_second_step_size is None else
                            integer(owner, "cycle_second_step_size", cycle_second_step_size, minimum=0))
        self.total_size = self.first_size + self.second_size
        self.first_stair_count = integer(owner, "cycle_first_stair_count", cycle_first_stair_count, minimum=0)
        self.second_stair_count = (  # DeepSpeed: the second defaults to the first
            self.first_stair_count if cycle_second_stair_count is None
            else integer(owner, "cycle_second_stair_count", cycle_second_stair_count, minimum=0))
        self.decay_step_size = integer(owner, "decay_step_size", decay_step_size, minimum=0)

        self.min_lrs = per_group(owner, "cycle_min_lr", cycle_min_lr, len(groups))
        self.max_lrs = per_group(owner, "cycle_max_lr", cycle_max_lr, len(groups))
        ordered(owner, "cycle_min_lr", self.min_lrs, "cycle_max_lr", self.max_lrs)
        self.decay_lr_rate = self._decay_rate("decay_lr_rate", decay_lr_rate, minimum=0.0)

        if not isinstance(cycle_momentum, bool):
            raise ValueError(f"OneCycle: cycle_momentum must be true or false, got {cycle_momentum!r}")
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            self.min_moms = [number(owner, "cycle_min_mom", m, maximum=1.0)
                             for m in per_group(owner, "cycle_min_mom", cycle_min_mom, len(groups))]
            self.max_moms = [number(owner, "cycle_max_mom", m, maximum=1.0)
                             for m in per_group(owner, "cycle_max_mom", cycle_max_mom, len(groups))]
            ordered(owner, "cycle_min_mom", self.min_moms, "cycle_max_mom", self.max_moms)
            self.decay_mom_rate = self._decay_rate("decay_mom_rate", decay_mom_rate, minimum=None)
            if "betas" not in getattr(self.optimizer, "defaults", {}):
                logger.warning("OneCycle: cycle_momentum is true but %s has no 'betas' in its defaults; the momentum "
                               "is not cycled (cycle_momentum false), as DeepSpeed does",
                               type(self.optimizer).__name__)
                self.cycle_momentum = False
            else:
                replaced = sorted({float(tuple(g["betas"])[1]) for g in groups if "betas" in g} - {0.99})
                if replaced:
                    logger.warning("OneCycle: cycle_momentum writes betas = (momentum, 0.99) as DeepSpeed does; "
                                   "the param groups' beta2 %s is replaced by 0.99", replaced)
        self._start()

    def _decay_rate(self, name: str, value: Any, minimum: float | None) -> float:
        rate = number("OneCycle", name, value, minimum=minimum)
        if rate != 0 and self.decay_step_size == 0:
            logger.warning("OneCycle: %s (%g) has no effect with decay_step_size 0; no decay after the cycle, "
                           "as in DeepSpeed (set decay_step_size > 0, the iterations per unit of decay)", name, rate)
        return rate

    def _scale(self) -> float:
        """How far up the cycle (0 at the bottom, 1 at the top) the current iteration is."""
        position = (self.last_batch_iteration + 1) % self.total_size  # the cycle's last iteration is at 0
        if position <= self.first_size:
            stairs, rise = self.first_stair_count, position / self.first_size
            return math.floor(position * stairs / self.first_size) / stairs if stairs else rise
        left, stairs = self.total_size - position, self.second_stair_count  # second_size > 0 here
        return math.floor(left * stairs / self.second_size) / stairs if stairs else left / self.second_size

    def _decay_factor(self, rate: float) -> float:
        past = self.last_batch_iteration - self.total_size + 1  # iterations past the cycle, from 1
        return 1.0 if self.decay_step_size == 0 else 1.0 + rate * past / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs, strict=True)]
        return [low / self._decay_factor(self.decay_lr_rate) for low in self.min_lrs]

    def get_mom(self) -> list[float] | None:
        """The momentum of each group at the current iteration; None without ``cycle_momentum``."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [high - (high - low) * scale for low, high in zip(self.min_moms, self.max_moms, strict=True)]
        return [high * self._decay_factor(self.decay_mom_rate) for high in self.max_moms]

    def _apply_momentum(self) -> None:
        momenta = self.get_mom()
        if momenta is None:
            return
        if self.last_batch_iteration == -1:  # DeepSpeed's construction: the cycle's lowest momentum
            momenta = self.min_moms
        for group, momentum in zip(self.optimizer.param_groups, momenta, strict=True):
            group["betas"] = (momentum, 0.99)  # DeepSpeed's tuple, beta2 included

    def step(self, batch_iteration: int | None = None) -> None:
        """Advance one iteration (or jump to ``batch_iteration``) and set the optimizer's rates and
        momentum."""
        self._advance(batch_iteration)
