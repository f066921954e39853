"""DeepSpeed's ``deepspeed.runtime.engine``."""

from .._engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
