"""DeepSpeed's ``deepspeed.utils.groups``: the process group, world size and rank of each kind of parallelism
this rank takes part in, read from the model-parallel unit (``mpu``) the engine registers.

``groups.mpu`` is the mpu: `ds_all.initialize` sets it to the one it was given, to the ds-parallel
`ModelParallelUnit` it built for ``tensor_parallel.autotp_size`` / ``sequence_parallel_size``, or to a
PipelineModule's topology (a `ds_comm.Grid`); a script may set it itself, as with DeepSpeed (any object with Megatron's
``get_data_parallel_group()``... methods). Without one, data parallelism is the whole world and every other
kind has one rank. The functions need the process group (``ds_all.comm.init_distributed`` or
``initialize``).

* data parallel: ``get_data_parallel_group / _world_size / _rank`` (DeepSpeed's ``_get_data_parallel_*`` too);
* model / tensor parallel: ``get_model_parallel_*``, ``get_tensor_model_parallel_*`` (with the setters of
  the tensor-parallel size and rank, and ``get_tensor_model_parallel_src_rank``);
* sequence parallel (Ulysses): ``get_sequence_parallel_*`` (one rank unless the mpu has more) and
  ``get_sequence_data_parallel_*`` (the data-parallel ones unless the mpu has its own);
* expert parallel (MoE): the ``ep_size_<N>`` expert-parallel and expert-data-parallel groups, ds-moe's
  (`ds_moe.groups`): ``_create_expert_and_data_parallel``, ``_get_expert_parallel_group / _ranks /
  _world_size / _rank``, ``_get_expert_data_parallel_*``, ``_get_max_expert_size``... (the engine creates
  them for a model's `MoE` layers at `initialize`).
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed

import ds_comm
from ds_moe import groups as _moe_groups

from .. import comm as dist  # DeepSpeed's groups.dist: `_init_tp_mesh_device` calls through it
from .._utils import log_dist

# the model-parallel unit: set by ds_all.initialize (as DeepSpeed's engine does) or by the script
mpu: Any = None

# DeepSpeed's tensor-parallel groups, made by `_init_tp_mesh_device`; while the tensor-parallel one is set, the
# data-, model- and tensor-parallel questions are answered from them instead of the mpu
_TENSOR_MODEL_PARALLEL_GROUP: Any = None
_MODEL_PARALLEL_GROUP: Any = None
_DATA_PARALLEL_GROUP: Any = None

# the message of torch's DeviceMesh when the backend cannot split a process group
_DEVICE_MESH_SPLIT_UNSUPPORTED = "No backend for the parent process group or its backend does not support splitting"

# set_tensor_model_parallel_world_size / _rank: values that replace the mpu's
_TENSOR_MODEL_PARALLEL_WORLD_SIZE: int | None = None
_TENSOR_MODEL_PARALLEL_RANK: int | None = None

__all__ = ["get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
           "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
           "get_sequence_data_parallel_group", "get_sequence_data_parallel_rank",
           "get_sequence_data_parallel_world_size", "get_sequence_parallel_group", "get_sequence_parallel_rank",
           "get_sequence_parallel_world_size", "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank",
           "get_tensor_model_parallel_src_rank", "get_tensor_model_parallel_world_size", "mpu",
           "set_tensor_model_parallel_rank", "set_tensor_model_parallel_world_size"]


def _require(what: str) -> None:
    if not ds_comm.is_initialized():
        raise RuntimeError(f"groups.{what}: no process group yet; call ds_all.comm.init_distributed() or "
                           "ds_all.initialize() first")


def _ask(name: str) -> Any:
    """The mpu's method ``name``, or None when there is no mpu or it has no such method."""
    return getattr(mpu, name, None) if mpu is not None else None


def _group_or_error(group: Any, kind: str, why: str) -> Any:
    if group is None:
        raise RuntimeError(f"groups: there is no {kind} group to return: {why}")
    return group


# ---- data parallel ----

def _init_tp_mesh_device(tensor_model_parallel_size: int = 1, data_parallel_size: int | None = None):
    """DeepSpeed's: make the data- and tensor-parallel groups of a (data, tensor) mesh over every rank (tensor
    fastest: tensor-parallel ranks are neighbours) and return ``(data-parallel group, model-parallel group)``;
    nothing when they exist already. The groups are made with ``dist.new_group`` (data-parallel groups first,
    then tensor-parallel ones, each in rank order), which gives the layout of DeepSpeed's DeviceMesh with or
    without ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (where DeepSpeed also uses new_group); they answer
    `get_data_parallel_group`, `get_model_parallel_group` and `get_tensor_model_parallel_group` from then on."""
    global _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GROUP
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return None
    tp = tensor_model_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"_init_tp_mesh_device: tensor_model_parallel_size must be an integer >= 1, got {tp!r}")
    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"_init_tp_mesh_device: tensor_model_parallel_size {tp} does not divide the world size {world}")
    dp = world // tp if data_parallel_size is None else data_parallel_size
    if dp * tp != world:
        raise ValueError(f"_init_tp_mesh_device: data_parallel_size {dp} × tensor_model_parallel_size {tp} must be the "
                         f"world size {world}")
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        log_dist("TORCH_DISTRIBUTED_DEBUG=DETAIL: the tensor-parallel mesh groups are made with new_group", ranks=[0])
    rank = dist.get_rank()
    data_group = tensor_group = None
    for tensor_rank in range(tp):
        ranks = list(range(tensor_rank, world, tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            data_group = group
    for data_rank in range(dp):
        ranks = list(range(data_rank * tp, (data_rank + 1) * tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            tensor_group = group
    _DATA_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GROUP = data_group, tensor_group
    _MODEL_PARALLEL_GROUP = tensor_group
    return _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP


def get_data_parallel_group():
    """The group of this rank's data-parallel replicas: `_init_tp_mesh_device`'s, the mpu's, else the whole
    world."""
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return _DATA_PARALLEL_GROUP
    _require("get_data_parallel_group")
    ask = _ask("get_data_parallel_group")
    return ask() if ask is not None else torch.distributed.group.WORLD


def get_data_parallel_world_size() -> int:
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return dist.get_world_size(_DATA_PARALLEL_GROUP)
    _require("get_data_parallel_world_size")
    ask = _ask("get_data_parallel_world_size")
    return ask() if ask is not None else ds_comm.get_world_size()


def get_data_parallel_rank() -> int:
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return dist.get_rank(_DATA_PARALLEL_GROUP)
    _require("get_data_parallel_rank")
    ask = _ask("get_data_parallel_rank")
    return ask() if ask is not None else ds_comm.get_rank()


def _get_data_parallel_group_ranks() -> list[int]:
    """The global ranks of this rank's data-parallel group."""
    _require("_get_data_parallel_group_ranks")
    ask = _ask("get_data_parallel_group_ranks")
    if ask is not None:
        return list(ask())
    group = get_data_parallel_group()
    return [ds_comm.get_global_rank(group, r) for r in range(ds_comm.get_world_size(group))]


# ---- model / tensor parallel ----

def get_model_parallel_world_size() -> int:
    """The mpu's model-parallel world size; 1 without an mpu."""
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return dist.get_world_size(_MODEL_PARALLEL_GROUP)
    _require("get_model_parallel_world_size")
    ask = _ask("get_model_parallel_world_size")
    return ask() if ask is not None else 1


def get_model_parallel_rank() -> int:
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return dist.get_rank(_MODEL_PARALLEL_GROUP)
    _require("get_model_parallel_rank")
    ask = _ask("get_model_parallel_rank")
    return ask() if ask is not None else 0


def get_model_parallel_group():
    """The mpu's model-parallel group. RuntimeError when there is none (no mpu, or a topology without a
    ``model`` axis): a group of this rank alone does not exist, and None would mean the whole world."""
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return _MODEL_PARALLEL_GROUP
    _require("get_model_parallel_group")
    ask = _ask("get_model_parallel_group")
    why = "no mpu is registered (model-parallel world size 1)" if mpu is None else \
        f"the mpu ({type(mpu).__name__}) has no model-parallel group (model-parallel world size 1)"
    return _group_or_error(ask() if ask is not None else None, "model-parallel", why)


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    """Replace the tensor-parallel world size the mpu gives (None: the mpu's again)."""
    global _TENSOR_MODEL_PARALLEL_WORLD_SIZE
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"set_tensor_model_parallel_world_size: world_size must be an integer >= 1 or None, "
                         f"got {world_size!r}")
    _TENSOR_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    """Replace the tensor-parallel rank the mpu gives (None: the mpu's again)."""
    global _TENSOR_MODEL_PARALLEL_RANK
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ValueError(f"set_tensor_model_parallel_rank: rank must be an integer >= 0 or None, got {rank!r}")
    _TENSOR_MODEL_PARALLEL_RANK = rank


def get_tensor_model_parallel_world_size() -> int:
    """The size set by `set_tensor_model_parallel_world_size`, else the mpu's tensor- (or model-) parallel size."""
    if _TENSOR_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _TENSOR_MODEL_PARALLEL_WORLD_SIZE
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return dist.get_world_size(_TENSOR_MODEL_PARALLEL_GROUP)
    ask = _ask("get_tensor_model_parallel_world_size")
    return ask() if ask is not None else get_model_parallel_world_size()


def get_tensor_model_parallel_rank() -> int:
    if _TENSOR_MODEL_PARALLEL_RANK is not None:
        return _TENSOR_MODEL_PARALLEL_RANK
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return dist.get_rank(_TENSOR_MODEL_PARALLEL_GROUP)
    ask = _ask("get_tensor_model_parallel_rank")
    return ask() if ask is not None else get_model_parallel_rank()


def get_tensor_model_parallel_group():
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return _TENSOR_MODEL_PARALLEL_GROUP
    ask = _ask("get_tensor_model_parallel_group")
    return ask() if ask is not None else get_model_parallel_group()


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's tensor-parallel group (neighbouring ranks)."""
    _require("get_tensor_model_parallel_src_rank")
    size = get_tensor_model_parallel_world_size()
    return (ds_comm.get_rank() // size) * size


# ---- sequence parallel ----

def get_sequence_parallel_world_size() -> int:
    """The mpu's sequence-parallel world size (``sequence_parallel_size``: the mpu `initialize` builds); 1 without
    one."""
    _require("get_sequence_parallel_world_size")
    ask = _ask("get_sequence_parallel_world_size")
    return ask() if ask is not None else 1


def get_sequence_parallel_rank() -> int:
    ask = _ask("get_sequence_parallel_rank")
    return ask() if ask is not None else 0


def get_sequence_parallel_group():
    ask = _ask("get_sequence_parallel_group")
    return _group_or_error(ask() if ask is not None else None, "sequence-parallel",
                           "the mpu has none (sequence-parallel world size 1)")


def get_sequence_data_parallel_world_size() -> int:
    """The mpu's sequence × data parallel world size, else the data-parallel one."""
    ask = _ask("get_sequence_data_parallel_world_size")
    return ask() if ask is not None else get_data_parallel_world_size()


def get_sequence_data_parallel_rank() -> int:
    ask = _ask("get_sequence_data_parallel_rank")
    return ask() if ask is not None else get_data_parallel_rank()


def get_sequence_data_parallel_group():
    ask = _ask("get_sequence_data_parallel_group")
    return ask() if ask is not None else get_data_parallel_group()


def _get_broadcast_src_rank() -> int:
    """The global rank of the first rank of this rank's sequence × data parallel group."""
    _require("_get_broadcast_src_rank")
    return ds_comm.get_global_rank(get_sequence_data_parallel_group(), 0)


# ---- DeepSpeed's own (underscored) names of the same, which scripts call ----

_get_data_parallel_group = get_data_parallel_group
_get_data_parallel_world_size = get_data_parallel_world_size
_get_data_parallel_rank = get_data_parallel_rank
_get_model_parallel_world_size = get_model_parallel_world_size
_get_sequence_parallel_world_size = get_sequence_parallel_world_size
_get_sequence_parallel_rank = get_sequence_parallel_rank
_get_sequence_parallel_group = get_sequence_parallel_group
_get_sequence_data_parallel_world_size = get_sequence_data_parallel_world_size
_get_sequence_data_parallel_rank = get_sequence_data_parallel_rank
_get_sequence_data_parallel_group = get_sequence_data_parallel_group


# ---- expert parallel (MoE): ds-moe's groups ----

_create_expert_and_data_parallel = _moe_groups._create_expert_and_data_parallel
_get_max_expert_size = _moe_groups._get_max_expert_size
_get_max_expert_size_name = _moe_groups._get_max_expert_size_name
_get_max_expert_parallel_group = _moe_groups._get_max_expert_parallel_group
_get_expert_parallel_group = _moe_groups._get_expert_parallel_group
_get_expert_parallel_group_ranks = _moe_groups._get_expert_parallel_group_ranks
_get_expert_parallel_world_size = _moe_groups._get_expert_parallel_world_size
_get_expert_parallel_rank = _moe_groups._get_expert_parallel_rank
_get_expert_parallel_src_rank = _moe_groups._get_expert_parallel_src_rank
_get_expert_data_parallel_group = _moe_groups._get_expert_data_parallel_group
_get_expert_data_parallel_group_ranks = _moe_groups._get_expert_data_parallel_group_ranks
_get_expert_data_parallel_world_size = _moe_groups._get_expert_data_parallel_world_size
_get_expert_data_parallel_rank = _moe_groups._get_expert_data_parallel_rank
_get_expert_broadcast_src_rank = _moe_groups._get_expert_broadcast_src_rank
_get_expert_parallel_group_dict = _moe_groups._get_expert_parallel_group_dict
_get_expert_data_parallel_group_dict = _moe_groups._get_expert_data_parallel_group_dict


def _create_expert_data_and_model_parallel(expert_parallel_size_, mpu, use_data_before_expert_parallel_=False):
    """DeepSpeed's: the ``ep_size_<N>`` expert groups laid out around ``mpu``'s tensor-parallel and pipeline
    sizes (ds-moe's `_create_expert_and_data_parallel` with ``mp_size``/``pp_size``); groups that exist stay."""
    _require("_create_expert_data_and_model_parallel")

    def size(*names: str) -> int:
        for name in names:
            ask = getattr(mpu, name, None) if mpu is not None else None
            if ask is not None:
                return int(ask())
        return 1

    mp_size = size("get_tensor_model_parallel_world_size", "get_model_parallel_world_size")
    pp_size = size("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")
    _moe_groups._create_expert_and_data_parallel(expert_parallel_size_, mp_size=mp_size, pp_size=pp_size,
                                                 use_data_before_expert_parallel_=use_data_before_expert_parallel_)


def _get_expert_model_parallel_world_size() -> int:
    """The experts' tensor-parallel world size: 1 (ds-moe builds no expert tensor parallelism)."""
    return 1
