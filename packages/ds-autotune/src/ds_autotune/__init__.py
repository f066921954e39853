"""ds-autotune: DeepSpeed's autotuner (see README.md). Standard library only; experiments are short runs of
the user's script through ``ds-launch``, whose engine (ds-all) writes the metric file."""

from ._autotuner import Autotuner
from ._config import AutotuningConfig
from ._keys import get_val_by_key, set_val_by_key
from ._launcher_args import launcher_options
from ._resources import ResourceManager
from ._runner import write_atomic
from ._space import instantiation_memory, prune
from ._tuners import BaseTuner, GridSearchTuner, ModelBasedTuner, RandomTuner

__version__ = "0.1.0"

__all__ = ["Autotuner", "AutotuningConfig", "BaseTuner", "GridSearchTuner", "ModelBasedTuner", "RandomTuner",
           "ResourceManager", "get_val_by_key", "instantiation_memory", "launcher_options", "prune",
           "set_val_by_key", "write_atomic"]
