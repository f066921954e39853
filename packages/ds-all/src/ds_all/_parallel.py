"""Tensor and sequence parallelism in `initialize` and the engine, as DeepSpeed's engine arranges them.

* ``tensor_parallel.autotp_size`` N > 1 (or ``tensor_parallel.tp.tp_size``): the ranks are split into
  tensor-parallel groups of N neighbours (ds-parallel's `ModelParallelUnit`, unless an ``mpu`` is given) and
  the model's linears are sliced by ds-parallel's `tp_model_init` (not again when the model already holds
  slices: built from ds-parallel's layers). ``ds_all.tp_model_init`` (DeepSpeed 0.19's) only records its
  arguments; `initialize` merges them into the config (`merge_recorded`).
* ``sequence_parallel_size`` P > 1: sequence-parallel groups of P ranks (DeepSpeed's Ulysses); ZeRO partitions
  and reduces over data × sequence ranks, and divides the summed gradients by the data-parallel size only
  (DeepSpeed's ``dp_world_size / sequence_parallel_size``): each sequence rank's loss is its share of the
  sequence's loss, and the shares add up.
* with an ``mpu`` whose model-parallel world size is above 1 (Megatron's, ds-parallel's), ZeRO's gradient norm
  adds the other model-parallel ranks' squares and counts a parameter without the ``tensor_model_parallel``
  mark (replicated on every tensor-parallel rank) on tensor-parallel rank 0 only.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

import ds_comm

from ._runtime_config import dtype_name
from .config import Config

logger = logging.getLogger("ds_all")


# what `tp_model_init` recorded for the next `initialize`: {"tp_size", "dtype", "tp_group"}, or None
_RECORDED: dict[str, Any] | None = None


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None, **kwargs: Any) -> nn.Module:
    """DeepSpeed's ``deepspeed.tp_model_init``: record the tensor-parallel size, dtype and (keyword
    ``tp_group``) group for the next `initialize`, which slices the model (AutoTP) and checks them against
    the config's ``tensor_parallel`` section (a mismatch is an error); returns ``model`` as it is, as
    DeepSpeed 0.19's does. ``config`` is accepted and unused, as in DeepSpeed."""
    global _RECORDED
    if not isinstance(model, nn.Module):
        raise ValueError(f"tp_model_init: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be an integer >= 1, got {tp_size!r}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tp_model_init: dtype must be a torch.dtype, got {dtype!r}")
    unknown = sorted(set(kwargs) - {"tp_group"})
    if unknown:
        raise ValueError(f"tp_model_init: unknown keyword argument(s) {', '.join(unknown)}; the keyword taken is "
                         "tp_group")
    _RECORDED = {"tp_size": tp_size, "dtype": dtype, "tp_group": kwargs.get("tp_group")}
    return model


def merge_recorded(config: Config, mpu: Any) -> Config:
    """The config with what `tp_model_init` recorded merged into its ``tensor_parallel`` section (DeepSpeed's
    merge_tp_model_init_into_config: the config wins where it says the same, a conflict is an error). The
    record is used once."""
    global _RECORDED
    recorded, _RECORDED = _RECORDED, None
    if recorded is None:
        return config
    tp_size, dtype, group = recorded["tp_size"], recorded["dtype"], recorded["tp_group"]
    if group is not None and mpu is not None:
        raise ValueError("initialize: tp_model_init was given a tp_group, so initialize must not receive an mpu "
                         "(DeepSpeed's rule); pass one of them")
    if group is not None and ds_comm.get_world_size(group) != tp_size:
        raise ValueError(f"tp_model_init: tp_size ({tp_size}) does not match the tp_group's size "
                         f"({ds_comm.get_world_size(group)})")
    if group is not None:  # the groups initialize builds: blocks of tp_size neighbouring ranks
        ranks = torch.distributed.get_process_group_ranks(group)
        if ranks != list(range(ranks[0], ranks[0] + tp_size)) or ranks[0] % tp_size:
            raise NotImplementedError(f"tp_model_init: a tp_group of ranks {ranks} is not implemented in ds-all: "
                                      f"the tensor-parallel groups are blocks of {tp_size} neighbouring ranks; pass "
                                      "no tp_group, or an mpu to initialize")
    data = config.as_dict()
    section = dict(data.get("tensor_parallel") or {})
    for key, given in (("autotp_size", section.get("autotp_size")), ("tp.tp_size", (section.get("tp") or {}).get(
            "tp_size"))):
        if given not in (None, tp_size):
            raise ValueError(f"initialize: tensor_parallel.{key} in the config ({given}) conflicts with "
                             f"tp_model_init's tp_size ({tp_size})")
    named = dtype_name(section.get("dtype"), "tensor_parallel.dtype")
    precision = "float16" if config.fp16.enabled is True else "bfloat16" if config.bf16.enabled is True else None
    for where, name in (("tensor_parallel.dtype", named), ("the fp16/bf16 sections", precision)):
        if name is not None and getattr(torch, name) != dtype:
            raise ValueError(f"initialize: {where} in the config ({name}) conflicts with tp_model_init's dtype "
                             f"({dtype})")
    section["autotp_size"] = tp_size
    section.setdefault("dtype", str(dtype))  # "torch.bfloat16": one of DeepSpeed's spellings
    data["tensor_parallel"] = section
    return Config.model_validate(data)


def parallel_sizes(config: Config) -> tuple[int, int]:
    """``(tensor-parallel size, sequence-parallel size)`` the config asks for (1: none). ``tp.tp_size``
    must agree with ``autotp_size`` when both are given (DeepSpeed's check)."""
    section = config.tensor_parallel
    autotp, tp_size = section.autotp_size, section.tensor_parallel.tp_size
    if autotp > 1 and tp_size not in (1, autotp):
        raise ValueError(f"tensor_parallel.tp.tp_size ({tp_size}) does not match tensor_parallel.autotp_size "
                         f"({autotp}); give one of them, or the same value")
    return max(autotp, tp_size, 1), max(config.sequence_parallel_size or 1, 1)


def _size(mpu: Any, *names: str) -> int:
    for name in names:
        ask = getattr(mpu, name, None)
        if ask is not None:
            return int(ask())
    return 1


def tensor_parallel_size(mpu: Any) -> int:
    return 1 if mpu is None else _size(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size")


def tensor_parallel_rank(mpu: Any) -> int:
    if tensor_parallel_size(mpu) == 1:
        return 0
    return _size(mpu, "get_tensor_model_parallel_rank", "get_model_parallel_rank")


def sequence_parallel_size(mpu: Any) -> int:
    return 1 if mpu is None else _size(mpu, "get_sequence_parallel_world_size")


def build_mpu(config: Config, mpu: Any, *, pipeline: bool) -> Any:
    """The mpu of this run: ``mpu`` when given (its sizes must be the config's), else, when the config asks
    for tensor or sequence parallelism, ds-parallel's `ModelParallelUnit` over every rank."""
    tp, sp = parallel_sizes(config)
    if tp == 1 and sp == 1:
        return mpu
    what = " and ".join(part for part in (f"tensor_parallel.autotp_size {tp}" if tp > 1 else "",
                                         f"sequence_parallel_size {sp}" if sp > 1 else "") if part)
    if pipeline:
        raise NotImplementedError(f"{what} with a PipelineModule is not implemented in ds-all: build the stages from "
                                  "ds-parallel's layers over a topology with a 'model' axis instead")
    world = ds_comm.get_world_size()
    if mpu is not None:
        for key, wanted, got in (("tensor_parallel.autotp_size", tp, tensor_parallel_size(mpu)),
                                 ("sequence_parallel_size", sp, sequence_parallel_size(mpu))):
            if wanted > 1 and got != wanted:
                raise ValueError(f"initialize: {key} is {wanted} but the mpu passed ({type(mpu).__name__}) has "
                                 f"{got}; give the same size, or leave the key out and let the mpu decide")
        return mpu
    if world % (tp * sp):
        raise ValueError(f"initialize: {what} ({tp * sp} ranks per model-parallel group) does not divide the "
                         f"world size {world}; the world size must be a multiple of it")
    import ds_parallel

    return ds_parallel.ModelParallelUnit(tensor_parallel_size=tp, sequence_parallel_size=sp)


def _sliced(model: nn.Module) -> bool:
    return any(getattr(p, "tensor_model_parallel", False) for p in model.parameters())


def apply_autotp(model: nn.Module, config: Config, mpu: Any) -> None:
    """With ``tensor_parallel.autotp_size`` > 1: slice ``model`` over the mpu's tensor-parallel group
    (ds-parallel's `tp_model_init`), unless it holds slices already."""
    tp, _ = parallel_sizes(config)
    if tp == 1 or _sliced(model) or getattr(model, "ds_autotp_parsed", False):
        return
    import ds_parallel

    name = dtype_name(config.tensor_parallel.dtype, "tensor_parallel.dtype")
    dtype = getattr(torch, name) if name is not None else next(
        (p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    group = mpu.get_tensor_model_parallel_group() if hasattr(mpu, "get_tensor_model_parallel_group") \
        else mpu.get_model_parallel_group()
    ds_parallel.tp_model_init(model, tp, dtype, tp_group=group)


def configure_engine(engine: Any) -> dict[str, Any]:
    """Set the engine's sequence-parallel attributes (DeepSpeed's ``sequence_parallel_size``,
    ``seq_parallel_group``, ``seq_data_parallel_group``, ``seq_dp_world_size``) and return how ZeRO
    partitions, reduces and counts the norm: ``group``, ``gradient_averaging_size``,
    ``communication_data_type`` (``seq_parallel_communication_data_type``), and with model
    parallelism ``model_parallel_group`` and ``tensor_parallel_rank``."""
    mpu = engine.mpu
    sp = sequence_parallel_size(mpu)
    engine.sequence_parallel_size = sp
    engine.seq_parallel_group = mpu.get_sequence_parallel_group() if sp > 1 else None
    if sp > 1:
        engine.seq_data_parallel_group = mpu.get_sequence_data_parallel_group()
        engine.seq_dp_world_size = ds_comm.get_world_size(engine.seq_data_parallel_group)
    else:
        engine.seq_data_parallel_group = engine.data_parallel_group
        engine.seq_dp_world_size = engine.dp_world_size
    options: dict[str, Any] = {}
    if sp > 1:
        options["group"] = engine.seq_data_parallel_group
        options["gradient_averaging_size"] = engine.dp_world_size
        options["communication_data_type"] = engine.config.seq_parallel_communication_data_type  # DeepSpeed's
    from ds_pipe import PipelineModule

    # a pipeline's norm spans its stages: PipelineEngine._zero_options names the group
    if mpu is not None and engine.mp_world_size > 1 and not isinstance(engine.module, PipelineModule):
        group = mpu.get_model_parallel_group()
        if group is not None:
            options["model_parallel_group"] = group
            options["tensor_parallel_rank"] = tensor_parallel_rank(mpu)
    if engine.global_rank == 0 and (sp > 1 or engine.mp_world_size > 1):
        logger.info("parallel groups: data %d, model %d, sequence %d, sequence × data %d", engine.dp_world_size,
                    engine.mp_world_size, sp, engine.seq_dp_world_size)
    return options


def consolidated_state_dict(engine: Any) -> dict | None:
    """``save_16bit_model``'s weights of a tensor-parallel model, whole (DeepSpeed's
    ``_replace_module_consolidated_state_dict``: AutoTP's slices gathered over their groups, on rank 0; {}
    elsewhere); None when the model holds no tensor-parallel slices (ZeRO's gather is the answer then)."""
    model = engine.module
    if engine.mp_world_size == 1 or not _sliced(model):
        return None
    if not getattr(model, "ds_autotp_parsed", False):
        raise NotImplementedError("save_16bit_model of a model built from tensor-parallel layers (Megatron-style) is "
                                  "not implemented in ds-all: its slices are not gathered into whole weights; use "
                                  "save_checkpoint, or AutoTP (tensor_parallel.autotp_size) on the unsliced model")
    if engine.config.zero_optimization.stage == 3:
        raise NotImplementedError("save_16bit_model of an AutoTP model at zero_optimization.stage 3 is not "
                                  "implemented in ds-all; use stage 0, 1 or 2")
    import ds_parallel

    state = ds_parallel.replace_module_consolidated_state_dict(model, rank0_only=True)
    return dict(state) if state is not None else {}
