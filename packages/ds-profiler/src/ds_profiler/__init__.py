"""ds-profiler: flops, MACs, parameters and latency of a PyTorch model, per module.

DeepSpeed's flops profiler API (``FlopsProfiler``, ``get_model_profile``) over a counting mode
that sees ``torch.nn.functional`` and tensor ops inside any module, so custom modules need no
hand-written counters. Layer 0 of ds: depends on torch and pydantic only.
"""

__version__ = "0.1.0"

from .api import get_model_profile
from .config import FlopsProfilerConfig
from .profile import ModuleProfile
from .profiler import FlopsProfiler

__all__ = ["FlopsProfiler", "FlopsProfilerConfig", "ModuleProfile", "__version__", "get_model_profile"]
