"""ds-data: the data side of training efficiency.

DeepSpeed's curriculum scheduler (``fixed_linear``, ``fixed_root``, ``fixed_discrete``, ``custom``), the
top-level sequence-length curriculum section (``curriculum_learning``), and progressive layer dropping
(``progressive_layer_drop``: the theta schedule and a drop-in block wrapper). Layer 2 of ds: depends on
ds-config, torch and numpy; ds-all wires it into the engine.
"""

__version__ = "0.1.0"

from ._curriculum import CurriculumScheduler
from ._pld import ProgressiveLayerDrop, ProgressiveLayerDropBlock
from .config import CurriculumLearningConfig, ProgressiveLayerDropConfig, ScheduleConfig

__all__ = ["CurriculumLearningConfig", "CurriculumScheduler", "ProgressiveLayerDrop", "ProgressiveLayerDropBlock",
           "ProgressiveLayerDropConfig", "ScheduleConfig", "__version__"]
