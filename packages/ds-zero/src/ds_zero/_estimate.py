"""Model-state memory per rank before building anything: the bytes `ZeroOptimizer.memory_bytes`
reports, from the parameter count alone (Adam's two states, float32 master copy)."""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)

_PRECISIONS = {"fp32": 4, "fp16": 2, "bf16": 2}


def estimate_zero_model_states_mem_needs(total_params: int, *, stage: int, world_size: int, precision: str = "bf16",
                                         offload_optimizer: bool = False, offload_param: bool = False,
                                         largest_layer_params: int = 0) -> dict[str, int]:
    """Bytes per rank by kind for ``total_params`` parameters trained with Adam at ZeRO ``stage``
    (0-3) on ``world_size`` ranks: ``params`` (2 or 4 per parameter, divided by the world size at
    stage 3, plus one whole ``largest_layer_params`` gathered), ``grads`` (the same width, divided by
    the world size from stage 2 on), ``master`` (a float32 copy of the stepped part; none in fp32, where
    the parameters are the master), ``optimizer`` (8: exp_avg and exp_avg_sq), each divided by the
    world size from stage 1 on; ``device`` and ``cpu``: where they live (``offload_optimizer``: master
    and states on the CPU; ``offload_param``, stage 3: the parameters' shards too). Padding (at most
    world_size elements per bucket) is left out."""
    for name, value in (("total_params", total_params), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if isinstance(largest_layer_params, bool) or not isinstance(largest_layer_params, int) or largest_layer_params < 0:
        raise ValueError(f"largest_layer_params must be an integer >= 0, got {largest_layer_params!r}")
    if offload_param and stage != 3:
        raise ValueError(f"offload_param needs stage 3, got stage {stage}")
    if precision not in _PRECISIONS:
        raise ValueError(f'precision must be "fp32", "fp16" or "bf16", got {precision!r}')
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer needs stage 1, 2 or 3, got stage 0")
    width = _PRECISIONS[precision]
    shards = world_size if stage >= 1 else 1
    gathered = width * largest_layer_params if stage == 3 else 0
    out = {"params": width * total_params // (world_size if stage == 3 else 1) + gathered,
           # stage 1: the whole local gradients (.grad) and this rank's averaged shard of them
           "grads": width * total_params // (world_size if stage >= 2 else 1) +
           (width * total_params // world_size if stage == 1 else 0),
           "master": 0 if precision == "fp32" else 4 * total_params // shards,
           "optimizer": 8 * total_params // shards}
    cpu = out["master"] + out["optimizer"] if offload_optimizer else 0
    if offload_param:
        cpu += out["params"] - gathered
    return {**out, "device": sum(out.values()) - cpu, "cpu": cpu}


def _count(model: nn.Module) -> int:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _check_node_arguments(num_gpus_per_node: int, num_nodes: int, additional_buffer_factor: float) -> None:
    if isinstance(additional_buffer_factor, bool) or not isinstance(additional_buffer_factor, (int, float)) \
            or additional_buffer_factor < 1:
        raise ValueError(f"additional_buffer_factor must be a number >= 1, got {additional_buffer_factor!r}")
    for name, value in (("num_gpus_per_node", num_gpus_per_node), ("num_nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> list[dict]:
    """DeepSpeed's estimator of the same name, with ds-zero's bytes: for 16-bit training with Adam
    at stage 2, with and without ``offload_optimizer``, the bytes per device and per node's CPU
    (times ``additional_buffer_factor`` on the CPU, DeepSpeed's allowance for buffers). Logged as a
    table and returned as rows."""
    _check_node_arguments(num_gpus_per_node, num_nodes, additional_buffer_factor)
    world_size = num_gpus_per_node * num_nodes
    rows = []
    for offload in (True, False):
        need = estimate_zero_model_states_mem_needs(total_params, stage=2, world_size=world_size, precision="bf16",
                                                    offload_optimizer=offload)
        rows.append({"offload_optimizer": offload, "per_device": need["device"],
                     "per_cpu": int(need["cpu"] * num_gpus_per_node * additional_buffer_factor)})
    lines = [f"Estimated memory for params, optimizer states and gradients (ZeRO stage 2, 16-bit, Adam): "
             f"{num_nodes} node(s), {num_gpus_per_node} device(s) per node, {total_params / 1e6:.1f}M parameters",
             "  per CPU  |  per device |   options"]
    lines += [f"{r['per_cpu'] / 2**30:8.2f}GB | {r['per_device'] / 2**30:8.2f}GB | "
              f"offload_optimizer={'cpu' if r['offload_optimizer'] else 'none'}" for r in rows]
    logger.info("\n".join(lines))
    return rows


def estimate_zero2_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> list[dict]:
    """`estimate_zero2_model_states_mem_needs_all_cold` for the parameters of ``model``."""
    return estimate_zero2_model_states_mem_needs_all_cold(_count(model), num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> list[dict]:
    """DeepSpeed's stage-3 estimator: 16-bit training with Adam at stage 3, for each of (offload_param,
    offload_optimizer) in (cpu, cpu), (none, cpu), (none, none): bytes per device (its shards plus
    the largest layer gathered whole) and per node's CPU (times ``additional_buffer_factor``). Logged as
    a table and returned as rows."""
    _check_node_arguments(num_gpus_per_node, num_nodes, additional_buffer_factor)
    world_size = num_gpus_per_node * num_nodes
    rows = []
    for offload_param, offload_optimizer in ((True, True), (False, True), (False, False)):
        need = estimate_zero_model_states_mem_needs(total_params, stage=3, world_size=world_size, precision="bf16",
                                                    offload_optimizer=offload_optimizer, offload_param=offload_param,
                                                    largest_layer_params=largest_layer_params)
        rows.append({"offload_param": offload_param, "offload_optimizer": offload_optimizer,
                     "per_device": need["device"],
                     "per_cpu": int(need["cpu"] * num_gpus_per_node * additional_buffer_factor)})
    lines = [f"Estimated memory for params, optimizer states and gradients (ZeRO stage 3, 16-bit, Adam): "
             f"{num_nodes} node(s), {num_gpus_per_node} device(s) per node, {total_params / 1e6:.1f}M parameters, "
             f"largest layer {largest_layer_params / 1e6:.1f}M", "  per CPU  |  per device |   options"]
    lines += [f"{r['per_cpu'] / 2**30:8.2f}GB | {r['per_device'] / 2**30:8.2f}GB | "
              f"offload_param={'cpu' if r['offload_param'] else 'none'}, "
              f"offload_optimizer={'cpu' if r['offload_optimizer'] else 'none'}" for r in rows]
    logger.info("\n".join(lines))
    return rows


def estimate_zero3_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> list[dict]:
    """`estimate_zero3_model_states_mem_needs_all_cold` for ``model``: its parameter count and its
    largest module's own parameters (what stage 3 gathers whole at once)."""
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return estimate_zero3_model_states_mem_needs_all_cold(_count(model), largest, num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor)
