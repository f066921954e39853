"""The engine's Mixture of Experts: DeepSpeed's MoE parts of ``_configure_distributed_model`` and of the
optimizer's configuration, over ds-moe's layers and ds-zero's per-group ``process_group``.

At `initialize`, a model holding `ds_moe.MoE` layers sets the engine's ``has_moe_layers``, ``num_experts``
(one entry per layer), ``moe_layers`` (the `MOELayer`\\ s) and ``gate_modules`` (the `TopKGate`\\ s), as
DeepSpeed's engine does; every module with ``set_deepspeed_parallelism`` is called with the config's
``use_data_before_expert_parallelism`` (this creates the ``ep_size_<N>`` expert groups, `ds_moe.groups`).
The optimizer's parameter groups then keep each expert group's parameters apart: a group
``{"params": ..., "moe": True, "name": "ep_size_<N>", "process_group": <its expert-data-parallel group>}``,
so ZeRO reduces an expert's gradients over the ranks holding that expert only (averaged by the
data-parallel world size: DeepSpeed's arithmetic, the result does not depend on ``ep_size``). Groups made by
``split_params_into_different_moe_groups_for_optimizer`` are kept as given; expert parameters left in
other groups are split out into groups of their own (DeepSpeed's ZeRO asserts instead). In checkpoints an
expert parameter is named by its global expert id (`ds_moe.expert_checkpoint_names`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import ds_moe
from ds_moe import groups as moe_groups
from ds_pipe import PipelineModule

logger = logging.getLogger("ds_all")


def configure(engine: Any) -> None:
    """Find the model's MoE layers and give them their expert groups (DeepSpeed's order: the layers are
    found, then every ``set_deepspeed_parallelism`` is called). Refuses what is not built with MoE."""
    model: nn.Module = engine.module
    layers = [m for m in model.modules() if isinstance(m, ds_moe.MoE)]
    engine.has_moe_layers = bool(layers)
    engine.num_experts = [layer.num_experts for layer in layers]
    engine.moe_layers = [m for m in model.modules() if isinstance(m, ds_moe.MOELayer)] if layers else []
    engine.gate_modules = [m for m in model.modules() if isinstance(m, ds_moe.TopKGate)] if layers else []
    if layers:
        _refuse_unbuilt(engine, model)
        for module in engine.gate_modules + engine.moe_layers:
            module.wall_clock_breakdown = bool(engine.config.wall_clock_breakdown)
    data_before_expert = bool(engine.config.use_data_before_expert_parallelism)
    for module in model.modules():
        if hasattr(module, "set_deepspeed_parallelism"):
            module.set_deepspeed_parallelism(data_before_expert)
    # DeepSpeed's engine attributes: {name: this rank's group}
    engine.expert_parallel_group = moe_groups._get_expert_parallel_group_dict()
    engine.expert_data_parallel_group = moe_groups._get_expert_data_parallel_group_dict()


def _refuse_unbuilt(engine: Any, model: nn.Module) -> None:
    stage = engine.config.zero_optimization.stage
    if stage == 3:
        raise NotImplementedError("initialize: a model with MoE layers (ds_moe.MoE) at zero_optimization.stage 3 is "
                                  "not implemented in ds-all (DeepSpeed refuses native MoE at stage 3 too): ZeRO "
                                  "stage 3 does not partition parameters over the expert-data-parallel groups; use "
                                  "stage 0, 1 or 2")
    if isinstance(model, PipelineModule):
        raise NotImplementedError("initialize: a PipelineModule with MoE layers (ds_moe.MoE) is not implemented in "
                                  "ds-all: the expert groups are laid over the whole world, not each pipeline "
                                  "stage's data-parallel ranks; train MoE with the plain engine (no pipeline)")
    if engine.dp_world_size != engine.world_size:
        raise NotImplementedError(f"initialize: MoE layers (ds_moe.MoE) with model parallelism (the mpu's "
                                  f"data-parallel world size is {engine.dp_world_size} of {engine.world_size} ranks) "
                                  "is not implemented in ds-all: the expert groups are laid over the whole world; "
                                  "train MoE with data and expert parallelism only")


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
    """``names`` (the engine's other checkpoint names, if any) with each local expert parameter named by its
    global expert id (`ds_moe.expert_checkpoint_names`)."""
    return {**(names or {}), **ds_moe.expert_checkpoint_names(model)}


def forward_breakdown(engine: Any) -> tuple[float, float, float, float]:
    """``(fwd_moe, 1st_a2a, 2nd_a2a, top_k)`` milliseconds of the last forward, summed over the MoE layers
    (recorded with ``wall_clock_breakdown``; 0 otherwise)."""
    moe = first = second = gate = 0.0
    for layer in engine.moe_layers:
        moe += layer.time_moe
        first += layer.time_falltoall
        second += layer.time_salltoall
        gate += layer.timings.get("topk_gate", getattr(layer.gate, "gate_time", 0.0))
    return moe, first, second, gate


def forget_expert_groups() -> None:
    """After the engine destroyed the process group it created: the expert groups went with it."""
    moe_groups._reset_expert_groups()
