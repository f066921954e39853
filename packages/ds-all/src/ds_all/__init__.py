"""ds-all: the whole of ds in one install: ``initialize()`` and the engine assembled from the parts,
``Config`` (a whole DeepSpeed config as one strict model), optimizers, learning-rate schedules and
monitors from the config. ``import ds_all as deepspeed`` runs a DeepSpeed training script:

    engine, optimizer, loader, scheduler = ds_all.initialize(model=model, config="ds_config.json",
                                                             training_data=dataset)
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

DeepSpeed's module tree is here, each module an alias of the part that owns it: ``ds_all.comm`` (ds-comm:
``import ds_all.comm as dist``), ``ds_all.zero`` (ds-zero), ``ds_all.ops`` (ds-ops, with ``ops.adam``,
``ops.lamb``, ...), ``ds_all.pipe`` (ds-pipe), ``ds_all.moe`` (ds-moe: ``deepspeed.moe.layer.MoE``),
``ds_all.accelerator`` (``get_accelerator()``), ``ds_all.elasticity`` (``compute_elastic_config``),
``ds_all.utils`` (``logger``, ``log_dist``, ``RepeatingLoader``),
``ds_all.runtime.*`` (the ``deepspeed.runtime`` paths scripts import), ``ds_all.sequence`` (ds-parallel's Ulysses:
``from ds_all.sequence.layer import DistributedAttention``), ``ds_all.tp_model_init`` (AutoTP, applied by
``initialize``). A ``PipelineModule`` given to
``initialize`` makes a ``PipelineEngine``; ``ds_all.versions()`` gives every part's version.
"""

from ds_comm import init_distributed
from ds_ops import get_accelerator

from . import (
    accelerator,
    checkpointing,
    comm,
    elasticity,
    git_version_info,
    hf,
    moe,
    monitor,
    ops,
    pipe,
    runtime,
    sequence,
    utils,
    zero,
)
from ._engine import DeepSpeedEngine
from ._initialize import add_config_arguments, initialize
from ._optimizers import build_optimizer
from ._parallel import tp_model_init
from ._parts import PARTS, versions
from ._pipe_engine import PipelineEngine
from ._scheduler_config import SchedulerConfig, build_scheduler
from ._version import DEEPSPEED_API_VERSION, DS_VERSION
from .config import Config
from .lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

# DeepSpeed's version attributes answer the DeepSpeed API version ds-all follows (scripts compare it with the
# DeepSpeed they need); ds-all's own release is beside it, as __ds_version__ (and in versions()).
__version__ = DEEPSPEED_API_VERSION
__ds_version__ = DS_VERSION
__version_major__, __version_minor__, __version_patch__ = (int(part) for part in __version__.split("."))
__git_hash__ = __git_branch__ = "[none]"  # DeepSpeed's value where the build recorded no git information

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
    "__ds_version__",
    "__git_branch__",
    "__git_hash__",
    "__version__",
    "__version_major__",
    "__version_minor__",
    "__version_patch__",
    "accelerator",
    "add_config_arguments",
    "build_optimizer",
    "build_scheduler",
    "checkpointing",
    "comm",
    "elasticity",
    "get_accelerator",
    "git_version_info",
    "hf",
    "init_distributed",
    "initialize",
    "moe",
    "monitor",
    "ops",
    "pipe",
    "runtime",
    "sequence",
    "tp_model_init",
    "utils",
    "versions",
    "zero",
]
