"""ds-data: the data side of training efficiency.

DeepSpeed's curriculum scheduler (``fixed_linear``, ``fixed_root``, ``fixed_discrete``, ``custom``), the
top-level sequence-length curriculum section (``curriculum_learning``), and progressive layer dropping
(``progressive_layer_drop``: the theta schedule and a drop-in block wrapper), the ``data_efficiency`` section's
model, data sampling by difficulty (``DataAnalyzer`` indexes a dataset by metrics into DeepSpeed's
``MMapIndexedDataset`` files; ``DataSampler`` draws each batch from the difficulty the schedule allows), variable
batch size and learning rate (micro-batches packed by token count, the learning rate scaled per batch), and random layerwise token dropping (``data_efficiency.data_routing.random_ltd``: a layer wrapper,
the conversion of a model's layers, the kept-length schedule). Layer 2 of ds: depends on
ds-config, torch and numpy; ds-all wires it into the engine.
"""

__version__ = "0.1.0"

from ._analyzer import DataAnalyzer
from ._curriculum import CurriculumScheduler
from ._indexed import MMapIndexedDataset, MMapIndexedDatasetBuilder
from ._pld import ProgressiveLayerDrop, ProgressiveLayerDropBlock
from ._random_ltd import RandomLayerTokenDrop, RandomLTDScheduler, convert_to_random_ltd
from ._sampler import DataSampler
from ._variable_batch import (
    VariableBatchSizeLR,
    batch_by_seqlens,
    dataloader_for_variable_batch_size,
    get_dataloader_and_lr_scheduler_for_variable_batch_size,
    get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed,
    lr_scheduler_for_variable_batch_size,
    scale_lr,
)
from .config import (
    CurriculumLearningConfig,
    DataEfficiencyConfig,
    ProgressiveLayerDropConfig,
    RandomLTDConfig,
    ScheduleConfig,
)

__all__ = ["CurriculumLearningConfig", "CurriculumScheduler", "DataAnalyzer", "DataEfficiencyConfig", "DataSampler",
           "MMapIndexedDataset", "MMapIndexedDatasetBuilder", "ProgressiveLayerDrop", "ProgressiveLayerDropBlock",
           "ProgressiveLayerDropConfig", "RandomLTDConfig", "RandomLTDScheduler", "RandomLayerTokenDrop",
           "ScheduleConfig", "VariableBatchSizeLR", "__version__", "batch_by_seqlens", "convert_to_random_ltd",
           "dataloader_for_variable_batch_size", "get_dataloader_and_lr_scheduler_for_variable_batch_size",
           "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed",
           "lr_scheduler_for_variable_batch_size", "scale_lr"]
