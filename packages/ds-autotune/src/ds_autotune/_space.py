"""The search space: memory estimates (DeepSpeed's arithmetic), pruning, and the experiments' configs.

An experiment is a plain dict ``{"name", "ds_config", "num_gpus", "num_nodes"}`` as DeepSpeed's
autotuner writes them to ``exps_dir``; its features for the tuners are ``exp["features"]``.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping
from typing import Any

from ._config import AutotuningConfig

log = logging.getLogger("ds_autotune")

# DeepSpeed's DEFAULT_TUNING_SPACE_ZERO_* knob that ds-zero acts on (the others are no-ops in ds): tuned when
# fast is false, at the best micro-batch size of the best stage
SLOW_MODE_SPACE = {"reduce_bucket_size": [5e7, 5e8, 1e9]}
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def host_memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    """Memory this machine can give now: ``MemAvailable`` of ``/proc/meminfo`` (``MemTotal`` if absent)."""
    fields = {}
    with open(meminfo) as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                fields[name] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1)
    for name in ("MemAvailable", "MemTotal"):
        if name in fields:
            return fields[name]
    raise RuntimeError(f"{meminfo} has neither MemAvailable nor MemTotal")


def memory_per_rank(model_info: Mapping, ranks_per_node: int, meminfo: str = "/proc/meminfo") -> int:
    """Memory one rank may use: the accelerator's (``device_memory_per_gpu`` of the model-info run),
    or on the CPU the machine's available memory shared by the node's ranks."""
    device = model_info.get("device_memory_per_gpu")
    if model_info.get("device_type", "cpu") != "cpu" and device:
        return int(device)
    return host_memory_bytes(meminfo) // max(ranks_per_node, 1)


def instantiation_memory(num_params: int, stage: int, total_gpus: int, *, fp16: bool = False, mp_size: int = 1,
                         offload_optimizer: bool = False) -> float:
    """Bytes per rank of parameters, gradients and Adam's states at a ZeRO stage: DeepSpeed's
    ``get_instantiation_memory_required_per_gpu`` (2+2+16 bytes per parameter with fp16, 4+4+8 without,
    stage >= 1 partitions the optimizer, >= 2 the gradients, 3 the parameters); with the optimizer
    offloaded its states live in host memory and count 0 here."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    params = num_params * (2 if fp16 else 4)
    grads = num_params * (2 if fp16 else 4)
    optim = 0 if offload_optimizer else num_params * (16 if fp16 else 8)
    if stage >= 1:
        optim /= total_gpus
    if stage >= 2:
        grads /= total_gpus
    if stage >= 3:
        params /= total_gpus
    return (params + grads + optim) / mp_size


def required_memory(exp: Mapping, model_info: Mapping, total_gpus: int, fp16: bool, mp_size: int) -> float:
    """Bytes per rank an experiment needs: instantiation + activation memory x micro-batch size."""
    cfg = exp["ds_config"]
    zero = cfg.get("zero_optimization", {})
    offload = bool(zero.get("offload_optimizer"))
    inst = instantiation_memory(model_info["num_params"], zero.get("stage", 0), total_gpus, fp16=fp16,
                                mp_size=mp_size, offload_optimizer=offload)
    return inst + model_info.get("activation_mem_per_gpu", 0) * cfg["train_micro_batch_size_per_gpu"]


def prune(exps: list[dict], model_info: Mapping, memory: int, total_gpus: int, fp16: bool,
          mp_size: int) -> tuple[list[dict], list[dict]]:
    """(experiments that fit in ``memory`` bytes per rank, those that do not: never run)."""
    kept, pruned = [], []
    for exp in exps:
        need = required_memory(exp, model_info, total_gpus, fp16, mp_size)
        exp["required_memory"] = int(need)
        if need > memory:
            log.info("pruned %s: needs about %s per rank, %s available", exp["name"], memory_string(need),
                     memory_string(memory))
            pruned.append(exp)
        else:
            kept.append(exp)
    return kept, pruned


def memory_string(n: float) -> str:
    for unit, size in (("TiB", 1024 ** 4), ("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def user_stages(user_config: Mapping) -> list[int]:
    """The stages to tune: ``zero_optimization.stage`` as an int, a list, or "all"; absent: 0-3."""
    stage = user_config.get("zero_optimization", {}).get("stage", "all")
    stages = [0, 1, 2, 3] if stage == "all" else stage if isinstance(stage, list) else [stage]
    for s in stages:
        if isinstance(s, bool) or s not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage to tune must be 0-3, a list of them or \"all\", got {stage!r}")
    return sorted(set(stages))


def user_gas(user_config: Mapping) -> int:
    gas = user_config.get("gradient_accumulation_steps", 1)
    if gas in (None, "auto") or isinstance(gas, list):
        return 1
    if isinstance(gas, bool) or not isinstance(gas, int) or gas < 1:
        raise ValueError(f"gradient_accumulation_steps must be a positive integer, got {gas!r}")
    return gas


def micro_batch_sizes(user_config: Mapping, at: AutotuningConfig, max_fitting: int) -> list[int]:
    """The micro-batch sizes to try: the user's list (``train_micro_batch_size_per_gpu: [..]``, which
    overrides the search as in DeepSpeed), else ``num_tuning_micro_batch_sizes`` sizes halving down from
    the largest that fits (capped by ``max_train_micro_batch_size_per_gpu``), none below the minimum."""
    given = user_config.get("train_micro_batch_size_per_gpu")
    if isinstance(given, list):
        sizes = sorted({s for s in given if isinstance(s, int) and not isinstance(s, bool)})
        if not sizes or any(s < 1 for s in sizes) or len(sizes) != len(set(given)):
            raise ValueError(f"train_micro_batch_size_per_gpu to tune must be a list of positive integers, "
                             f"got {given!r}")
        return sizes
    top = min(max_fitting, at.max_train_micro_batch_size_per_gpu)
    low = at.min_train_micro_batch_size_per_gpu
    if top < low:
        return []
    sizes = {top}
    size = top
    while len(sizes) < at.num_tuning_micro_batch_sizes and size // 2 >= low:
        size //= 2
        sizes.add(size)
    return sorted(sizes)


def first_config(config: Any) -> Any:
    """DeepSpeed's ``get_first_config``: every list (outside ``optimizer``) replaced by its first item."""
    if isinstance(config, Mapping):
        return {k: (copy.deepcopy(v) if k == "optimizer" else first_config(v)) for k, v in config.items()}
    if isinstance(config, list) and config:
        return config[0]
    return copy.deepcopy(config)


def experiment_name(stage: int, mbs: int, gas: int, offload: bool = False, extra: Mapping | None = None) -> str:
    """DeepSpeed's micro-batch experiment names: ``z<stage>_gas<gas>_tmbspg<mbs>`` (+ our suffixes)."""
    name = f"z{stage}{'_off' if offload else ''}_gas{gas}_tmbspg{mbs}"
    for key, value in (extra or {}).items():
        acronym = "".join(part[0] for part in key.split("_"))
        name += f"_{acronym}{value:.0e}" if isinstance(value, float) else f"_{acronym}{value}"
    return name.replace("+", "")


def make_experiment(user_config: Mapping, at: AutotuningConfig, *, stage: int, mbs: int, max_per_gpu: int,
                    num_gpus: int, num_nodes: int, offload: bool = False, extra: Mapping | None = None) -> dict:
    """One experiment: the user's config (first of each list) at this stage and micro-batch size, with
    gradient accumulation ``max_per_gpu // mbs`` (DeepSpeed's constant samples per rank per step)."""
    cfg = first_config({k: v for k, v in user_config.items() if k != "autotuning"})
    zero = dict(cfg.get("zero_optimization") or {})
    zero["stage"] = stage
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    else:
        zero.pop("offload_optimizer", None)
    if stage != 3:
        zero.pop("offload_param", None)
    zero.update(extra or {})
    cfg["zero_optimization"] = zero
    gas = max(max_per_gpu // mbs, 1)
    cfg["train_micro_batch_size_per_gpu"] = mbs
    cfg["gradient_accumulation_steps"] = gas
    cfg["train_batch_size"] = mbs * gas * num_gpus * num_nodes // at.mp_size
    features = [float(stage), 1.0 if offload else 0.0, math.log2(mbs), math.log2(gas)]
    features += [math.log10(v) if isinstance(v, (int, float)) and v > 0 else 0.0 for v in (extra or {}).values()]
    return {"name": experiment_name(stage, mbs, gas, offload, extra), "ds_config": cfg, "num_gpus": num_gpus,
            "num_nodes": num_nodes, "features": features}


def max_train_batch_size_per_gpu(user_config: Mapping, at: AutotuningConfig, sizes: list[int],
                                 total_gpus: int) -> int:
    """Samples per rank per optimizer step, kept constant over the micro-batch sizes (DeepSpeed's):
    from ``max_train_batch_size`` when given, else the largest size x the user's accumulation."""
    if at.max_train_batch_size:
        return max(at.max_train_batch_size * at.mp_size // total_gpus, 1)
    return max(sizes) * user_gas(user_config) // at.mp_size if sizes else 1
