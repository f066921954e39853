"""ds-zero: the Zero Redundancy Optimizer for a plain PyTorch loop.

This version holds the configuration of ZeRO and mixed precision (``zero_optimization``,
``fp16``, ``bf16``); stages 0-2 land next (see the package README).
"""

from .config import BF16Config, FP16Config, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__version__ = "0.1.0"

__all__ = ["BF16Config", "FP16Config", "OffloadOptimizerConfig", "OffloadParamConfig", "ZeroConfig", "__version__"]
