"""`initialize()` and `add_config_arguments()`: DeepSpeed's entry points, signature for signature."""

from __future__ import annotations

import argparse
import logging
import random
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import ds_comm
from ds_pipe import PipelineModule

from . import _parallel
from ._engine import DeepSpeedEngine
from ._pipe_engine import PipelineEngine
from .config import Config
from .utils import groups

logger = logging.getLogger("ds_all")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's arguments to ``parser``: ``--deepspeed`` (a flag), ``--deepspeed_config PATH``
    (also spelt ``--ds_config``), and the deprecated ``--deepscale``/``--deepscale_config``."""
    if not isinstance(parser, argparse.ArgumentParser):
        raise ValueError(f"add_config_arguments: parser must be an argparse.ArgumentParser, got {type(parser).__name__}")
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on ds_all.initialize)")
    group.add_argument("--deepspeed_config", "--ds_config", dest="deepspeed_config", default=None, type=str,
                       help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    if config is not None and config_params is not None:
        raise ValueError("initialize: config and config_params are both given (config_params is its older name); "
                         "pass one")
    config = config if config is not None else config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None and config is not None:
        raise ValueError(f"initialize: a config is given both as args.deepspeed_config ({from_args!r}) and as "
                         "config=; pass one")
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("initialize: no DeepSpeed config: pass config= (a dict, a JSON file's path or a "
                         "ds_all.Config) or args with --deepspeed_config")
    return config


def _show_progress_logs() -> None:
    """The engine's progress lines (logger ``ds_all`` at INFO, rank 0) reach stdout unless the
    application configured logging itself."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[ds_all] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Callable | None = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """Returns ``(engine, optimizer, training_dataloader, lr_scheduler)`` as DeepSpeed's does.

    ``model``: the module to train (on the CPU); ``config``: a DeepSpeed config (dict, JSON path or
    `Config`; or ``args.deepspeed_config``), every ``"auto"`` in it already resolved (see
    ``ds_all.hf.resolve_auto``). The optimizer is ``optimizer`` (a torch optimizer over the model's
    parameters, rebound to ZeRO's buffers, or a callable taking the parameters), else the config's
    ``optimizer`` section; the schedule is ``lr_scheduler`` (an object, or a callable taking the
    optimizer), else the config's ``scheduler``. ``training_data``: a Dataset, loaded per
    data-parallel rank. The process group is created when none exists (ds-launch, torchrun, MPI or
    SLURM tell the rank); ``mpu`` gives the data-parallel group (and the model- and sequence-parallel
    ones: ZeRO's norm and reductions follow them, see ``_parallel``). ``tensor_parallel.autotp_size`` and
    ``sequence_parallel_size`` in the config build such an mpu (ds-parallel's `ModelParallelUnit`) when none
    is given, and AutoTP slices the model over its tensor-parallel group. ``mesh_param=(data, sequence)`` is
    DeepSpeed's other spelling of ``data_parallel_size`` and ``sequence_parallel_size``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    source = _config_source(args, config, config_params)
    owns_group = False
    if not ds_comm.is_initialized():
        if dist_init_required is False:
            raise RuntimeError("initialize: dist_init_required=False but no process group exists; create one "
                               "(ds_comm.init_distributed) or leave dist_init_required unset")
        ds_comm.init_distributed()
        owns_group = True
    pipeline = isinstance(model, PipelineModule)
    if pipeline:
        if mpu is not None:
            raise ValueError("initialize: a PipelineModule brings its own topology (model.mpu()); do not pass mpu")
        mpu = model.mpu()  # the data-parallel group is the stage's replicas
    try:
        loaded = _parallel.merge_recorded(Config.load(source), mpu)  # what ds_all.tp_model_init recorded
        loaded = _parallel.apply_mesh_param(loaded, mesh_param)  # DeepSpeed's (data, sequence) mesh
        _parallel.autotp_mode(loaded)  # autotp_size > 0: AutoTP's training mode, as DeepSpeed's initialize
        # tensor_parallel.autotp_size / sequence_parallel_size: ds-parallel's mpu (unless one is given)
        mpu = _parallel.build_mpu(loaded, mpu, pipeline=pipeline)
        dp_world_size = ds_comm.get_world_size(mpu.get_data_parallel_group() if mpu is not None else None)
        resolved = loaded.resolve(dp_world_size=dp_world_size)
        _check_parallel_sizes(resolved, dp_world_size)
        _parallel.apply_autotp(model, resolved, mpu)  # the model sliced over the tensor-parallel group
        if resolved.seed is not None:
            random.seed(resolved.seed)
            torch.manual_seed(resolved.seed)
        _show_progress_logs()
        if resolved.log_level is not None:  # after the progress logs' own level, which it overrides
            _set_log_level(resolved.log_level)
        engine_class = PipelineEngine if pipeline else DeepSpeedEngine
        engine = engine_class(model=model, config=resolved, optimizer=optimizer, model_parameters=model_parameters,
                              lr_scheduler=lr_scheduler, training_data=training_data, collate_fn=collate_fn,
                              mpu=mpu, owns_process_group=owns_group)
    except BaseException:
        if owns_group:  # nothing half-built is left behind: the group this call created goes too
            ds_comm.destroy_process_group()
        raise
    if mpu is not None:  # ds_all.utils.groups answers from it from now on, as DeepSpeed's engine arranges
        groups.mpu = mpu
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


# The loggers log_level sets: DeepSpeed's ("DeepSpeed", ds_all.utils.logger) and every ds package's.
_LOGGERS = ("DeepSpeed", "ds_all", "ds_zero", "ds_pipe", "ds_comm", "ds_ops", "ds_io", "ds_compress", "ds_profiler",
            "ds_config", "ds_data", "ds_moe")


def _set_log_level(level: str) -> None:
    """``log_level``: DeepSpeed's set_log_level_from_string, for its logger and each ds package's."""
    for name in _LOGGERS:
        log = logging.getLogger(name)
        log.setLevel(level.upper())
        for handler in log.handlers:
            handler.setLevel(level.upper())


def _check_parallel_sizes(config: Config, dp_world_size: int) -> None:
    """``data_parallel_size`` (with ``sequence_parallel_size``: DeepSpeed's device mesh, whose product is the
    world size) must describe the ranks there are."""
    dp, sp = config.data_parallel_size, config.sequence_parallel_size
    if dp is None or dp == dp_world_size:
        return
    if sp is not None:
        raise ValueError(f"data_parallel_size {dp} × sequence_parallel_size {sp} must be the {dp_world_size} "
                         f"data-parallel ranks of this run (DeepSpeed builds its device mesh from them)")
    logging.getLogger(__name__).warning("data_parallel_size %d is not the %d data-parallel ranks of this run; DeepSpeed "
                                        "reads it only with sequence_parallel_size, and so it is ignored", dp,
                                        dp_world_size)
