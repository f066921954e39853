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
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

import ds_comm

from ._runtime_config import dtype_name
from .config import Config
from .module_inject.layers import set_autotp_mode

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
    set_autotp_mode(training=True)  # as DeepSpeed's
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
        raise ValueError("initialize: tp_model_init provided tp_group, so initialize must not receive an mpu "
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
            raise ValueError(f"initialize: Conflicting dtype: {where} in the config ({name}) conflicts with "
                             f"tp_model_init's dtype ({dtype})")
    section["autotp_size"] = tp_size
    section.setdefault("dtype", str(dtype))  # "torch.bfloat16": one of DeepSpeed's spellings
    data["tensor_parallel"] = section
    return Config.model_validate(data)


def apply_mesh_param(config: Config, mesh_param: Any) -> Config:
    """``initialize(mesh_param=(data, sequence))``, DeepSpeed's device mesh: the config's ``data_parallel_size``
    and ``sequence_parallel_size`` (where the config gives them too, they must be the same)."""
    if mesh_param is None:
        return config
    if (not isinstance(mesh_param, (tuple, list)) or len(mesh_param) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in mesh_param)):
        raise ValueError(f"initialize: mesh_param must be (data_parallel_size, sequence_parallel_size), two integers "
                         f">= 1, got {mesh_param!r}")
    data = config.as_dict()
    for key, value in zip(("data_parallel_size", "sequence_parallel_size"), mesh_param, strict=True):
        if data.get(key) not in (None, value):
            raise ValueError(f"initialize: mesh_param {tuple(mesh_param)} gives {key} {value}, the config {data[key]}")
        data[key] = value
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
    if mpu is not None and hasattr(mpu, "initialize_sequence_parallel"):
        # DeepSpeed reads such an mpu (its parallel_state_sp) as sequence parallelism alone: its model-parallel
        # answers are the sequence ones and it has no data-parallel group. ds-parallel's mpu of the same
        # sequence-parallel size has the same sequence groups (neighbouring ranks) and the data groups beside.
        import ds_parallel

        if sp > 1 and sp != mpu.get_sequence_parallel_world_size():
            raise ValueError(f"initialize: sequence_parallel_size is {sp} but the mpu passed has "
                             f"{mpu.get_sequence_parallel_world_size()}; give the same size, or leave the key out")
        if tp > 1:
            raise ValueError("initialize: a sequence-parallel mpu (parallel_state_sp) has no tensor-parallel groups; "
                             f"tensor_parallel.autotp_size {tp} needs another mpu, or none")
        return ds_parallel.ModelParallelUnit(sequence_parallel_size=mpu.get_sequence_parallel_world_size())
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


def autotp_mode(config: Config) -> None:
    """DeepSpeed's: ``tensor_parallel.autotp_size`` above 0 switches AutoTP to training mode."""
    if config.tensor_parallel.autotp_size > 0:
        set_autotp_mode(training=True)


def _tp_group(mpu: Any) -> Any:
    return mpu.get_tensor_model_parallel_group() if hasattr(mpu, "get_tensor_model_parallel_group") \
        else mpu.get_model_parallel_group()


def apply_autotp(model: nn.Module, config: Config, mpu: Any) -> None:
    """With ``tensor_parallel.autotp_size`` > 1: slice ``model`` over the mpu's tensor-parallel group: by the
    rules of ``tensor_parallel.partition_config`` when given (ds-parallel's `apply_partition_config`: layers
    built from ds-parallel's already are left), else by recognised names (ds-parallel's `tp_model_init`)
    unless it holds slices already."""
    tp, _ = parallel_sizes(config)
    if tp == 1 or getattr(model, "ds_autotp_parsed", False):
        return
    import ds_parallel

    rules = config.tensor_parallel.partition_config
    if rules is not None:
        ds_parallel.apply_partition_config(model, rules, _tp_group(mpu))
        return
    if _sliced(model):
        return

    name = dtype_name(config.tensor_parallel.dtype, "tensor_parallel.dtype")
    dtype = getattr(torch, name) if name is not None else next(
        (p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    ds_parallel.tp_model_init(model, tp, dtype, tp_group=_tp_group(mpu))


class ParallelGroups:
    """The run's process groups, built from the mpu (None: data parallelism over every rank), the config and the
    module; DeepSpeed's engine attributes ``mpu``, ``data_parallel_group``, ``dp_world_size``, ``mp_world_size``,
    ``sequence_parallel_size``, ``seq_parallel_group``, ``seq_data_parallel_group``, ``seq_dp_world_size`` and
    ``checkpoint_mp_rank`` are this part's, read through the engine's properties. `zero_options` says how ZeRO
    partitions, reduces and counts the norm; `prepare` readies the module for AutoTP (the replicas made equal, the
    first batch checked); the tensor-parallel state dicts gather AutoTP's slices."""

    def __init__(self, mpu: Any, config: Config, module: nn.Module, *, global_rank: int) -> None:
        self.config, self.module, self.global_rank = config, module, global_rank
        self.mpu = mpu
        self.dp_group = mpu.get_data_parallel_group() if mpu is not None else None  # None: every rank
        # DeepSpeed's attribute is a process group a script asks .rank()/.size() of (the variable-batch example):
        # without an mpu, the world's, as DeepSpeed's groups._get_data_parallel_group() answers
        self.data_parallel_group = self.dp_group if self.dp_group is not None else torch.distributed.group.WORLD
        self.dp_world_size = ds_comm.get_world_size(self.dp_group)
        self.mp_world_size = mpu.get_model_parallel_world_size() if mpu is not None else 1
        sp = sequence_parallel_size(mpu)
        self.sequence_parallel_size = sp
        # DeepSpeed's: the model-parallel rank this rank's checkpoint files are named by (0 without model parallelism)
        self.checkpoint_mp_rank = mpu.get_model_parallel_rank() if mpu is not None and self.mp_world_size > 1 else 0
        self.seq_parallel_group = mpu.get_sequence_parallel_group() if sp > 1 else None
        if sp > 1:
            self.seq_data_parallel_group = mpu.get_sequence_data_parallel_group()
            self.seq_dp_world_size = ds_comm.get_world_size(self.seq_data_parallel_group)
        else:
            self.seq_data_parallel_group = self.data_parallel_group
            self.seq_dp_world_size = self.dp_world_size

    def zero_options(self) -> dict[str, Any]:
        """How ZeRO partitions, reduces and counts the norm: ``group``, ``gradient_averaging_size``,
        ``communication_data_type`` (``seq_parallel_communication_data_type``) with sequence parallelism, and with
        model parallelism ``model_parallel_group`` and ``tensor_parallel_rank``."""
        options: dict[str, Any] = {}
        if self.sequence_parallel_size > 1:
            options["group"] = self.seq_data_parallel_group
            options["gradient_averaging_size"] = self.dp_world_size
            options["communication_data_type"] = self.config.seq_parallel_communication_data_type  # DeepSpeed's
        from ds_pipe import PipelineModule

        # a pipeline's norm spans its stages: PipelineEngine._zero_options names the group
        mpu = self.mpu
        if mpu is not None and self.mp_world_size > 1 and not isinstance(self.module, PipelineModule):
            group = mpu.get_model_parallel_group()
            if group is not None:
                options["model_parallel_group"] = group
                options["tensor_parallel_rank"] = tensor_parallel_rank(mpu)
        return options

    def prepare(self, device: torch.device) -> None:
        """Under AutoTP: what it left whole made the same on every tensor-parallel rank (`synchronize_replicas`)
        and the first batch checked across each tensor-parallel group (`check_tensor_parallel_inputs`); the
        groups logged on global rank 0."""
        autotp_size = self.config.tensor_parallel.autotp_size
        synchronize_replicas(self.module, self.mpu, autotp_size)
        check_tensor_parallel_inputs(self.module, self.mpu, autotp_size, device)
        if self.global_rank == 0 and (self.sequence_parallel_size > 1 or self.mp_world_size > 1):
            logger.info("parallel groups: data %d, model %d, sequence %d, sequence × data %d", self.dp_world_size,
                        self.mp_world_size, self.sequence_parallel_size, self.seq_dp_world_size)

    def release(self) -> None:
        """After the engine destroyed the process group it created: drop the dead handles (held, they would keep
        the group's store serving on MASTER_PORT and its gloo threads running)."""
        self.data_parallel_group = self.seq_data_parallel_group = self.seq_parallel_group = None
        self.dp_group = self.mpu = None

    def _whole_state(self) -> dict | None:
        """The module's weights whole on global rank 0 (None elsewhere): the slices of ds-parallel's AutoTP layers
        (`LinearLayer`, `LinearAllreduce`, however the model got them) gathered over their groups. A collective."""
        import ds_parallel

        model = self.module
        autotp = (ds_parallel.LinearLayer, ds_parallel.LinearAllreduce)
        in_layers = {id(p) for m in model.modules() if isinstance(m, autotp) for p in m.parameters(recurse=False)}
        other = [n for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)
                 and id(p) not in in_layers]
        if other:
            raise NotImplementedError(f"the whole weights of a model built from Megatron-style tensor-parallel layers "
                                      f"({', '.join(other[:3])}...) are not implemented in ds-all: their slices are "
                                      "not gathered; use save_checkpoint, or AutoTP's layers")
        if self.config.zero_optimization.stage == 3:
            raise NotImplementedError("the whole weights of an AutoTP model at zero_optimization.stage 3 are not "
                                      "implemented in ds-all; use stage 0, 1 or 2")
        return ds_parallel.replace_module_consolidated_state_dict(model, rank0_only=True)

    def consolidated_state_dict(self) -> dict | None:
        """``save_16bit_model``'s weights of a tensor-parallel model, whole (DeepSpeed's
        ``_replace_module_consolidated_state_dict``: AutoTP's slices gathered over their groups, on rank 0; {}
        elsewhere); None when the model holds no tensor-parallel slices (ZeRO's gather is the answer then)."""
        if self.mp_world_size == 1 or not _sliced(self.module):
            return None
        state = self._whole_state()
        return dict(state) if state is not None else {}

    def tp_consolidated_16bit_state_dict(self) -> dict | None:
        """DeepSpeed's ``_consolidated_16bit_state_dict`` under AutoTP (``autotp_size`` > 1, stages 0-2): the
        module's state dict with every AutoTP slice gathered, CPU copies, on global rank 0; None elsewhere. Every
        rank calls it."""
        if self.mp_world_size == 1 or not _sliced(self.module):
            state = OrderedDict((k, v.detach().to("cpu", copy=True)) for k, v in self.module.state_dict().items())
            return state if self.global_rank == 0 else None
        return self._whole_state()


class TensorParallelInputMismatch(ValueError, AssertionError):
    """The ranks of a tensor-parallel group were given different inputs (DeepSpeed raises an AssertionError
    with this message; this is both)."""


# DeepSpeed's message, word for word: code (and DeepSpeed's tests) compare it
_MISMATCH = "Data inconsistency within the TP group. Please check the Dataloader implementation to ensure consistency."


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a.detach().cpu(), b.detach().cpu()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # no usable == (an array's is elementwise): the same object only
        return a is b


class TensorParallelInputCheck:
    """DeepSpeed's first-batch check under AutoTP: before the module's first forward, the tensor-parallel
    group's first rank sends its inputs to the others, each compares them with its own, and if any rank's
    differ every rank raises `TensorParallelInputMismatch` (the ranks of a tensor-parallel group must see the
    same batch). After a forward whose inputs agree the check is removed."""

    def __init__(self, module: nn.Module, group: Any, device: torch.device) -> None:
        self.group, self.device = group, device
        self.src = ds_comm.get_global_rank(group, 0)
        self.handle = module.register_forward_pre_hook(self, prepend=True, with_kwargs=True)

    def _check(self, values: Any) -> bool:
        box = [values if ds_comm.get_rank() == self.src else None]
        torch.distributed.broadcast_object_list(box, src=self.src, group=self.group, device=self.device)
        agree = torch.tensor([1.0 if _same(values, box[0]) else 0.0], device=self.device)
        ds_comm.all_reduce(agree, op=ds_comm.ReduceOp.MIN, group=self.group)
        return bool(agree.item() == 1.0)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        consistent = self._check(list(args)) and self._check(kwargs)
        if not consistent:
            raise TensorParallelInputMismatch(_MISMATCH)
        logger.info("the inputs agree across the tensor-parallel group")
        self.handle.remove()


def synchronize_replicas(module: nn.Module, mpu: Any, autotp_size: int) -> None:
    """Under AutoTP over more than one rank, every parameter not sliced (no ``tensor_model_parallel`` mark: norms,
    embeddings, row-parallel biases, linears left whole) is made the same on each tensor-parallel group's ranks,
    broadcast from its first rank. AutoTP computes as one model only when they are (a row-parallel layer sums
    partial products of the same input), and a checkpoint keeps one copy of them; DeepSpeed leaves them as each
    rank built them."""
    if autotp_size <= 1 or mpu is None or tensor_parallel_size(mpu) <= 1:
        return
    group = _tp_group(mpu)
    src = ds_comm.get_global_rank(group, 0)
    with torch.no_grad():
        for param in module.parameters():
            if not getattr(param, "tensor_model_parallel", False):
                ds_comm.broadcast(param.data, src=src, group=group)


def check_tensor_parallel_inputs(module: nn.Module, mpu: Any, autotp_size: int,
                                 device: torch.device) -> TensorParallelInputCheck | None:
    """Under AutoTP over more than one rank, the `TensorParallelInputCheck` of ``module``."""
    if autotp_size <= 1 or mpu is None or tensor_parallel_size(mpu) <= 1:
        return None
    return TensorParallelInputCheck(module, _tp_group(mpu), device)
