"""DeepSpeed's optimizer wrapper classes as views of ds-zero's one `ZeroOptimizer`.

DeepSpeed wraps the client optimizer in a class per case: ``FP16_Optimizer`` (stage 0, fp16, a fused Adam),
``FP16_UnfusedOptimizer`` (stage 0, fp16, any other optimizer), ``DeepSpeedZeroOptimizer`` (stages 1-2),
``DeepSpeedZeroOptimizer_Stage3`` (stage 3). ds has one class for all of them; each name here is a class whose
``isinstance`` answers whether an engine's optimizer is in that case, so code that branches on DeepSpeed's
classes takes the same branch. They are not constructed (a ``TypeError`` says so)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ds_ops import FusedAdam
from ds_zero import ZeroOptimizer


class _Kind(type):
    """A metaclass whose instances (the classes below) test a `ZeroOptimizer` by ``_matches``."""

    _matches: Callable[[Any], bool]

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, ZeroOptimizer) and cls._matches(instance)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return subclass is cls

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{cls.__name__} is DeepSpeed's name for a case of ds_zero.ZeroOptimizer and is not "
                        "constructed; ds_all.initialize builds the optimizer")


def _fp16_stage0(opt: Any) -> bool:
    return opt.stage == 0 and opt.dtype == torch.float16


class DeepSpeedZeroOptimizer(metaclass=_Kind):
    """ZeRO stage 1 or 2."""

    _matches = staticmethod(lambda opt: opt.stage in (1, 2))


class DeepSpeedZeroOptimizer_Stage3(metaclass=_Kind):  # DeepSpeed's name
    """ZeRO stage 3."""

    _matches = staticmethod(lambda opt: opt.stage == 3)


class FP16_Optimizer(metaclass=_Kind):  # DeepSpeed's name
    """Stage 0 in fp16 over a fused Adam."""

    _matches = staticmethod(lambda opt: _fp16_stage0(opt) and isinstance(opt.optimizer, FusedAdam))


class FP16_UnfusedOptimizer(metaclass=_Kind):  # DeepSpeed's name
    """Stage 0 in fp16 over any other optimizer."""

    _matches = staticmethod(lambda opt: _fp16_stage0(opt) and not isinstance(opt.optimizer, FusedAdam))
