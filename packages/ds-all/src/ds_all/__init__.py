"""ds-all: the whole of ds in one install: ``initialize()`` and the engine assembled from the parts,
``Config`` (a whole DeepSpeed config as one strict model), optimizers, learning-rate schedules and
monitors from the config. ``import ds_all as deepspeed`` runs a DeepSpeed training script:

    engine, optimizer, loader, scheduler = ds_all.initialize(model=model, config="ds_config.json",
                                                             training_data=dataset)
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

``ds_all.comm``, ``ds_all.zero``, ``ds_all.ops`` and ``ds_all.pipe`` are ds-comm, ds-zero, ds-ops and ds-pipe
(DeepSpeed's ``deepspeed.comm``, ``deepspeed.zero``, ``deepspeed.ops``, ``deepspeed.pipe``); a
``PipelineModule`` given to ``initialize`` makes a ``PipelineEngine``; ``ds_all.versions()`` gives every
part's version.
"""

import ds_comm as comm
import ds_ops as ops
import ds_zero as zero
from ds_comm import init_distributed

from . import checkpointing, hf, monitor, pipe
from ._engine import DeepSpeedEngine
from ._initialize import add_config_arguments, initialize
from ._optimizers import build_optimizer
from ._parts import PARTS, versions
from ._pipe_engine import PipelineEngine
from ._scheduler_config import SchedulerConfig, build_scheduler
from .config import Config
from .lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__version__ = "0.1.0"

__all__ = [
    "PARTS",
    "Config",
    "DeepSpeedEngine",
    "LRRangeTest",
    "OneCycle",
    "PipelineEngine",
    "SchedulerConfig",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "__version__",
    "add_config_arguments",
    "build_optimizer",
    "build_scheduler",
    "checkpointing",
    "comm",
    "hf",
    "init_distributed",
    "initialize",
    "monitor",
    "ops",
    "pipe",
    "versions",
    "zero",
]
