"""The engine's Mixture of Experts: DeepSpeed's MoE parts of ``_configure_distributed_model`` and of the
optimizer's configuration, over ds-moe's layers and ds-zero's per-group ``process_group``.

At `initialize`, the engine builds a `MoEWiring` part: a model holding `ds_moe.MoE` layers gets DeepSpeed's
engine attributes ``has_moe_layers``, ``num_experts`` (one entry per layer), ``moe_layers`` (the `MOELayer`\\ s)
and ``gate_modules`` (the `TopKGate`\\ s), which the engine's properties read from the part; every module with
``set_deepspeed_parallelism`` is called with the config's ``use_data_before_expert_parallelism`` (this creates
the ``ep_size_<N>`` expert groups, `ds_moe.groups`).
The optimizer's parameter groups then keep each expert group's parameters apart: a group
``{"params": ..., "moe": True, "name": "ep_size_<N>", "process_group": <its expert-data-parallel group>}``,
so ZeRO reduces an expert's gradients over the ranks holding that expert only (averaged by the
data-parallel world size: DeepSpeed's arithmetic, the result does not depend on ``ep_size``). Groups made by
``split_params_into_different_moe_groups_for_optimizer`` are kept as given; expert parameters left in
other groups are split out into groups of their own (DeepSpeed's ZeRO asserts instead). In checkpoints an
expert parameter or buffer is named by its global expert id (`ds_moe.expert_checkpoint_names`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import ds_moe
from ds_moe import groups as moe_groups

from ._checkpoint import META_FILE
from ._train_state import Restore

logger = logging.getLogger("ds_all")


class MoEWiring:
    """The model's MoE layers wired to their expert groups, built from the model, the config and the data-parallel
    sizes: DeepSpeed's engine attributes ``has_moe_layers``, ``num_experts`` (one entry per layer), ``moe_layers``
    (the `MOELayer`\\ s), ``gate_modules`` (the `TopKGate`\\ s), ``expert_parallel_group`` and
    ``expert_data_parallel_group`` (``{name: this rank's group}``) are this part's, read through the engine's
    properties. Building it runs DeepSpeed's order: the layers are found, then every ``set_deepspeed_parallelism``
    is called (this creates the ``ep_size_<N>`` expert groups). Refuses what is not built with MoE."""

    def __init__(self, module: nn.Module, config: Any, *, dp_world_size: int, world_size: int) -> None:
        layers = [m for m in module.modules() if isinstance(m, ds_moe.MoE)]
        self.has_moe_layers = bool(layers)
        self.num_experts = [layer.num_experts for layer in layers]
        self.moe_layers = [m for m in module.modules() if isinstance(m, ds_moe.MOELayer)] if layers else []
        self.gate_modules = [m for m in module.modules() if isinstance(m, ds_moe.TopKGate)] if layers else []
        if layers:
            _refuse_unbuilt(config.zero_optimization.stage, dp_world_size, world_size)
            for layer in self.gate_modules + self.moe_layers:
                layer.wall_clock_breakdown = bool(config.wall_clock_breakdown)
        data_before_expert = bool(config.use_data_before_expert_parallelism)
        for layer in module.modules():
            if hasattr(layer, "set_deepspeed_parallelism"):
                layer.set_deepspeed_parallelism(data_before_expert)
        self.expert_parallel_group = moe_groups._get_expert_parallel_group_dict()
        self.expert_data_parallel_group = moe_groups._get_expert_data_parallel_group_dict()

    @staticmethod
    def pipeline_refusal(config: Any, module: nn.Module) -> Exception | None:
        """Why a `PipelineEngine` cannot train ``module`` with this part (None: it can)."""
        if not any(isinstance(m, ds_moe.MoE) for m in module.modules()):
            return None
        return NotImplementedError("initialize: a PipelineModule with MoE layers (ds_moe.MoE) is not implemented in "
                                   "ds-all: the expert groups are laid over the whole world, not each pipeline "
                                   "stage's data-parallel ranks; train MoE with the plain engine (no pipeline)")

    def forward_breakdown(self) -> tuple[float, float, float, float]:
        """``(fwd_moe, 1st_a2a, 2nd_a2a, top_k)`` milliseconds of the last forward, summed over the MoE layers
        (recorded with ``wall_clock_breakdown``; 0 otherwise)."""
        moe = first = second = gate = 0.0
        for layer in self.moe_layers:
            moe += layer.time_moe
            first += layer.time_falltoall
            second += layer.time_salltoall
            gate += layer.timings.get("topk_gate", getattr(layer.gate, "gate_time", 0.0))
        return moe, first, second, gate


def _refuse_unbuilt(stage: int, dp_world_size: int, world_size: int) -> None:
    if stage == 3:
        raise NotImplementedError("initialize: a model with MoE layers (ds_moe.MoE) at zero_optimization.stage 3 is "
                                  "not implemented in ds-all (DeepSpeed refuses native MoE at stage 3 too): ZeRO "
                                  "stage 3 does not partition parameters over the expert-data-parallel groups; use "
                                  "stage 0, 1 or 2")
    if dp_world_size != world_size:
        raise NotImplementedError(f"initialize: MoE layers (ds_moe.MoE) with model parallelism (the mpu's "
                                  f"data-parallel world size is {dp_world_size} of {world_size} ranks) "
                                  "is not implemented in ds-all: the expert groups are laid over the whole world; "
                                  "train MoE with data and expert parallelism only")


class MoELayout:
    """The model's MoE layers as a part of a checkpoint: ``{layer name: [num_experts, ep_size]}`` recorded in the
    metadata; at load, a change of ``ep_size`` is logged (``log``: this rank logs) and nothing else is needed
    (ZeRO names each expert by its global id)."""

    restore = Restore.ALWAYS

    def __init__(self, module: nn.Module, *, log: bool) -> None:
        self.module, self.log = module, log

    def state_dict(self) -> dict[str, list[int]]:
        return {prefix: [layer.num_experts, layer.ep_size] for prefix, layer in self.module.named_modules()
                if isinstance(layer, ds_moe.MoE)}

    def load_state_dict(self, saved: dict[str, list[int]] | None) -> None:
        now = self.state_dict()
        changed = {name: (saved[name][1], layout[1]) for name, layout in now.items()
                   if saved and name in saved and saved[name][1] != layout[1]}
        if changed and self.log:
            logger.info("load_checkpoint: the checkpoint was saved at another ep_size (layer: saved -> now) %s; "
                        "each rank reads its experts by their global ids", changed)


def _expert_process_group(name: str) -> Any:
    return moe_groups._get_expert_data_parallel_group(name)


def param_groups(groups: list[dict[str, Any]] | None, trainable: list[torch.Tensor]) -> list[dict[str, Any]]:
    """ZeRO's parameter groups with every expert parameter in a group of its expert group name carrying
    that group's ``process_group`` (``groups`` None: one group of every trainable parameter). A group of
    one expert group's parameters stays where it is (marked ``moe``/``name``, as DeepSpeed's split marks
    it); expert parameters in any other group are split out into groups appended after the given ones, in
    DeepSpeed's order (for each group, for each expert group name), with that group's options."""
    given = groups if groups is not None else [{"params": list(trainable)}]
    kept: list[dict[str, Any]] = []
    appended: list[dict[str, Any]] = []
    for i, group in enumerate(given):
        dense: list[torch.Tensor] = []
        experts: dict[str, list[torch.Tensor]] = {}
        for p in group["params"]:
            if ds_moe.is_moe_param(p):
                experts.setdefault(p.group_name, []).append(p)
            else:
                dense.append(p)
        if group.get("moe") and dense:
            raise ValueError(f"initialize: parameter group {i} is marked 'moe' (an expert group) but holds "
                             f"{len(dense)} parameters that are not experts' (no allreduce=False mark); build the "
                             "groups with ds_all.moe.utils.split_params_into_different_moe_groups_for_optimizer")
        if not dense and len(experts) == 1:  # already one expert group's parameters
            name = next(iter(experts))
            kept.append({**group, "moe": True, "name": name, "process_group": _expert_process_group(name)})
            continue
        if dense or not experts:
            kept.append({**group, "params": dense})
        for name, params in experts.items():
            appended.append({**group, "params": params, "moe": True, "name": name,
                             "process_group": _expert_process_group(name)})
    if appended:
        logger.info("initialize: the expert parameters of %s are in parameter groups of their own (their "
                    "expert-data-parallel process groups)", sorted({g["name"] for g in appended}))
    return kept + appended


def optimizer_groups(optimizer: Any, factory: Callable, groups: list[dict[str, Any]] | None,
                     trainable: list[torch.Tensor], lr_scheduler: Any) -> tuple[Callable, list[dict[str, Any]]]:
    """The factory and ZeRO's groups of `DeepSpeedEngine._optimizer_factory` with the experts split out
    (`param_groups`). A client torch optimizer of one group gets a group per expert group name (as with
    DeepSpeed's split): a schedule object already built over its one group would not reach them, so that is
    refused by name."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if groups is None:  # the client's one group: its options, over every trainable parameter
            options = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
            groups = [{**options, "params": list(trainable)}]
            factory = _rebind_groups(optimizer)
        result = param_groups(groups, trainable)
        base_lrs = getattr(lr_scheduler, "base_lrs", None)
        if base_lrs is not None and len(base_lrs) != len(result):
            raise ValueError(f"initialize: the lr_scheduler was built over the optimizer's {len(base_lrs)} parameter "
                             f"group(s), but with MoE the optimizer steps {len(result)} (each expert group's "
                             "parameters in a group of their own); build the optimizer over "
                             "ds_all.moe.utils.split_params_into_different_moe_groups_for_optimizer(...) groups "
                             "before the schedule, or pass lr_scheduler as a callable taking the optimizer")
        return factory, result
    if optimizer is None and groups is None:  # DeepSpeed's configure_moe_param_groups: the dense group's name
        groups = [{"params": list(trainable), "name": "dense-params"}]
    return factory, param_groups(groups, trainable)


def _rebind_groups(optimizer: torch.optim.Optimizer) -> Callable:
    """The client optimizer rebound to ZeRO's groups over its tensors (the object kept)."""
    def rebind(tensor_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        optimizer.param_groups.clear()
        optimizer.state.clear()
        for group in tensor_groups:
            optimizer.add_param_group(group)
        return optimizer

    return rebind


def checkpoint_names(model: nn.Module, names: dict[str, str] | None) -> dict[str, str]:
    """``names`` (the engine's other checkpoint names, if any) with each local expert parameter and buffer
    named by its global expert id (`ds_moe.expert_checkpoint_names`)."""
    return {**(names or {}), **ds_moe.expert_checkpoint_names(model)}


def forget_expert_groups() -> None:
    """After the engine destroyed the process group it created: the expert groups went with it."""
    moe_groups._reset_expert_groups()


_EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."


def _expert_parallel(group_name: str, ep_size: int, where: str) -> tuple[int, int]:
    """``(expert-parallel rank, expert-parallel world size)`` of the ``group_name`` expert groups; ``(0, 1)``
    at ``ep_size`` 1 when they were not made (every expert is local)."""
    if group_name in moe_groups._get_expert_parallel_group_dict():
        return moe_groups._get_expert_parallel_rank(group_name), moe_groups._get_expert_parallel_world_size(group_name)
    if ep_size == 1:
        return 0, 1
    raise RuntimeError(f"{where}: the {group_name} expert groups do not exist; build the engine (ds_all.initialize) "
                       "or call MoE.set_deepspeed_parallelism() first")


def _read_expert(path: str, layer_id: int, global_id: int, local_id: int, checkpoint_engine: Any,
                 where: str) -> dict[str, torch.Tensor]:
    """One expert's file, its keys renamed from the global expert id to the local one."""
    if not os.path.isfile(path):
        layer = "" if layer_id < 0 else f"MoE layer {layer_id}, "
        raise FileNotFoundError(f"{where}: no checkpoint file for {layer}expert {global_id} (global id; local "
                                f"expert {local_id} of this rank): {path}")
    cpu = torch.device("cpu")
    loaded = checkpoint_engine.load(path, map_location=cpu) if checkpoint_engine is not None else \
        torch.load(path, map_location=cpu, weights_only=True)
    old, new = f"{_EXPERTS}{global_id}.", f"{_EXPERTS}{local_id}."
    return {key.replace(old, new, 1): value for key, value in loaded.items()}


def load_moe_state_dict(checkpoint_path: Any, tag: Any, state_dict: dict, old_moe_load: bool,
                        model: nn.Module | None = None, mpu: Any = None, num_experts: Any = 1,
                        checkpoint_engine: Any = None, autoep_layers: Any = None, folding_spec: Any = None,
                        checkpoint_mp_rank: int | None = None) -> None:
    """DeepSpeed's ``DeepSpeedEngine.load_moe_state_dict``: read this rank's experts from the per-expert
    files of a DeepSpeed checkpoint into ``state_dict`` (in place), under their local expert indices."""
    where = "load_moe_state_dict"
    if autoep_layers is not None or folding_spec is not None:
        raise NotImplementedError(f"{where}: AutoEP layers (autoep_layers, folding_spec) are not implemented in "
                                  "ds-all")
    tag_dir = os.path.join(os.fspath(checkpoint_path), "" if tag is None else str(tag))
    if os.path.isfile(os.path.join(tag_dir, META_FILE)):
        raise ValueError(f"{where}: {tag_dir} is a checkpoint ds-all wrote ({META_FILE}); its experts are in "
                         "ZeRO's sharded files, not in DeepSpeed's per-expert files: use engine.load_checkpoint")
    if checkpoint_mp_rank is None:
        checkpoint_mp_rank = 0 if mpu is None else mpu.get_model_parallel_rank()

    def file(layer_id: int, expert_id: int) -> str:
        layer = "" if layer_id < 0 else f"layer_{layer_id}_"
        return os.path.join(tag_dir, f"{layer}expert_{expert_id}_mp_rank_{checkpoint_mp_rank:02d}_model_states.pt")

    if old_moe_load:  # one file per expert, holding every layer's copy of it
        if not moe_groups._get_expert_parallel_group_dict():
            raise RuntimeError(f"{where}: old_moe_load needs the expert groups; build the engine (ds_all.initialize) "
                               "or call MoE.set_deepspeed_parallelism() first")
        name = moe_groups._get_max_expert_size_name()
        rank, size = _expert_parallel(name, moe_groups._get_max_expert_size(), where)
        local = max(num_experts if isinstance(num_experts, (list, tuple)) else [num_experts]) // size
        for local_id in range(local):
            global_id = rank * local + local_id
            state_dict.update(_read_expert(file(-1, global_id), -1, global_id, local_id, checkpoint_engine, where))
        return
    if model is None:
        raise ValueError(f"{where}: model must be the module holding the MoE layers (old_moe_load=False reads "
                         "each layer's experts), got None")
    layer_id = 0
    for module in model.modules():
        if not isinstance(module, ds_moe.MoE):
            continue
        rank, _ = _expert_parallel(module.expert_group_name, module.ep_size, where)
        for local_id in range(module.num_local_experts):
            global_id = rank * module.num_local_experts + local_id
            state_dict.update(_read_expert(file(layer_id, global_id), layer_id, global_id, local_id,
                                           checkpoint_engine, where))
        layer_id += 1
