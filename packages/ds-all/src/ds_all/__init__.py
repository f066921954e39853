"""ds-all: the whole of ds in one install. For now it assembles the parts and reports them;
``initialize()``, the engine and ``Config`` land here as the packages below arrive.

    >>> import ds_all
    >>> ds_all.versions()        # {'ds-all': '0.1.0', 'ds-launch': '0.1.0', ...}
"""

from ._parts import PARTS, versions
from ._scheduler_config import SchedulerConfig, build_scheduler
from .lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__version__ = "0.1.0"

__all__ = [
    "PARTS",
    "LRRangeTest",
    "OneCycle",
    "SchedulerConfig",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "__version__",
    "build_scheduler",
    "versions",
]
