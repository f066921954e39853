"""ds-all: the whole of ds in one install: the parts assembled, ``Config`` (a whole DeepSpeed
config as one strict model) and the learning-rate schedules; ``initialize()`` and the engine land
here as the packages below arrive.

    >>> import ds_all
    >>> ds_all.versions()        # {'ds-all': '0.1.0', 'ds-launch': '0.1.0', ...}
    >>> ds_all.Config.load("ds_config.json").resolve(dp_world_size=2)
"""

from ._optimizers import build_optimizer
from ._parts import PARTS, versions
from ._scheduler_config import SchedulerConfig, build_scheduler
from .config import Config
from .lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__version__ = "0.1.0"

__all__ = [
    "PARTS",
    "Config",
    "LRRangeTest",
    "OneCycle",
    "SchedulerConfig",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "__version__",
    "build_optimizer",
    "build_scheduler",
    "versions",
]
