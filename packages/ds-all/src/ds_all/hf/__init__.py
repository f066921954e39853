"""The Hugging Face Transformers integration's ``"auto"`` values, resolved from a TrainingArguments.

    config = ds_all.hf.resolve_auto("ds_config.json", training_args, model=model, num_training_steps=1000)
    engine, optimizer, _, scheduler = ds_all.initialize(model=model, config=config)

Each ``"auto"`` the Transformers integration guide lists gets the value the Trainer gives it: the batch
triad from ``per_device_train_batch_size``, ``gradient_accumulation_steps`` and the world size;
``gradient_clipping`` from ``max_grad_norm``; the optimizer's ``lr``, ``betas``, ``eps`` and
``weight_decay``; the scheduler's warmup and total steps; ``fp16``/``bf16.enabled``; and the ZeRO bucket
sizes from the model's hidden size. A value written explicitly that disagrees with the arguments is an
error listing every such pair (the Trainer refuses them too); nothing is guessed where an input is
missing: the key is named instead.

A Hugging Face ``Trainer`` script (``TrainingArguments(deepspeed="ds_config.json")``) runs on ds with one
line added before its Transformers imports, ``import ds_all.hf.trainer`` (see `ds_all.hf.trainer`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from ds_config import ConfigError, load_ds_config

import ds_comm

_MISSING = object()


def _hidden_size(model: Any, hidden_size: int | None) -> int | None:
    if hidden_size is not None:
        return hidden_size
    config = getattr(model, "config", None)
    if config is None:
        return None
    if getattr(config, "hidden_size", None):
        return int(config.hidden_size)
    sizes = getattr(config, "hidden_sizes", None)
    return int(max(sizes)) if sizes else None


def _warmup_steps(args: Any, num_training_steps: int | None) -> int | None:
    """TrainingArguments' warmup: ``get_warmup_steps`` where it exists; else ``warmup_steps`` (steps, or a
    fraction of the training steps when below 1, as Transformers 5 reads it) or ``warmup_ratio``."""
    getter = getattr(args, "get_warmup_steps", None)
    if callable(getter) and num_training_steps is not None:
        return int(getter(num_training_steps))
    steps = getattr(args, "warmup_steps", 0) or 0
    ratio = steps if 0 < steps < 1 else (getattr(args, "warmup_ratio", 0) or 0)
    if steps >= 1:
        return int(steps)
    if ratio == 0:
        return 0
    return None if num_training_steps is None else math.ceil(num_training_steps * ratio)


def _world_size(args: Any, world_size: int | None) -> int:
    if world_size is not None:
        return world_size
    if ds_comm.is_initialized():
        return ds_comm.get_world_size()
    return int(getattr(args, "world_size", None) or os.environ.get("WORLD_SIZE", 1))


def resolve_auto(config: Any, training_args: Any, *, model: Any = None, hidden_size: int | None = None,
                 num_training_steps: int | None = None, world_size: int | None = None) -> dict[str, Any]:
    """A copy of the DeepSpeed ``config`` (dict or JSON path) with the integration's ``"auto"`` values
    filled in from ``training_args`` (a ``transformers.TrainingArguments`` or any object with its
    attribute names), ``model`` (its ``config.hidden_size``, or ``hidden_size=``) and
    ``num_training_steps``. Explicit values that disagree with the arguments raise one
    `ds_config.ConfigError` listing each pair; an ``"auto"`` whose input was not given raises naming
    the key and the input it needs. ``"auto"`` keys the integration does not know are left for
    `ds_all.initialize` to refuse."""
    data = load_ds_config(config) if not isinstance(config, Mapping) else config
    data = _deep_copy(data)
    args = training_args
    world = _world_size(args, world_size)
    micro = getattr(args, "per_device_train_batch_size", _MISSING)
    gas = getattr(args, "gradient_accumulation_steps", _MISSING)
    size = _hidden_size(model, hidden_size)
    warmup = _warmup_steps(args, num_training_steps)
    fp16 = bool(getattr(args, "fp16", False) or getattr(args, "fp16_full_eval", False))
    bf16 = bool(getattr(args, "bf16", False) or getattr(args, "bf16_full_eval", False))
    lr = getattr(args, "learning_rate", _MISSING)
    # (config key, value from the arguments or _MISSING / None when unknown, where it comes from)
    rules = [
        ("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size"),
        ("gradient_accumulation_steps", gas, "gradient_accumulation_steps"),
        ("train_batch_size", _MISSING if _MISSING in (micro, gas) else micro * gas * world,
         "per_device_train_batch_size × gradient_accumulation_steps × world size"),
        ("gradient_clipping", getattr(args, "max_grad_norm", _MISSING), "max_grad_norm"),
        ("optimizer.params.lr", lr, "learning_rate"),
        ("optimizer.params.betas", _pair(args), "adam_beta1, adam_beta2"),
        ("optimizer.params.eps", getattr(args, "adam_epsilon", _MISSING), "adam_epsilon"),
        ("optimizer.params.weight_decay", getattr(args, "weight_decay", _MISSING), "weight_decay"),
        ("scheduler.params.warmup_min_lr", 0, "0 (the Trainer's)"),
        ("scheduler.params.warmup_max_lr", lr, "learning_rate"),
        ("scheduler.params.warmup_num_steps", warmup, "warmup_steps, or warmup_ratio × num_training_steps"),
        ("scheduler.params.total_num_steps", num_training_steps, "num_training_steps="),
        ("fp16.enabled", fp16, "fp16 or fp16_full_eval"),
        ("bf16.enabled", bf16, "bf16 or bf16_full_eval"),
        ("zero_optimization.reduce_bucket_size", None if size is None else size * size,
         "hidden_size² (model.config.hidden_size or hidden_size=)"),
        ("zero_optimization.stage3_prefetch_bucket_size", None if size is None else int(0.9 * size * size),
         "0.9 × hidden_size² (model.config.hidden_size or hidden_size=)"),
        ("zero_optimization.stage3_param_persistence_threshold", None if size is None else 10 * size,
         "10 × hidden_size (model.config.hidden_size or hidden_size=)"),
    ]
    problems = []
    for key, value, source in rules:
        holder, leaf = _locate(data, key)
        if holder is None or leaf not in holder:
            continue
        current = holder[leaf]
        if current == "auto":
            if value is _MISSING or value is None:
                problems.append((key, f'is "auto" and needs {source}, which was not given'))
            else:
                holder[leaf] = value
        elif value is not _MISSING and value is not None and key != "scheduler.params.warmup_min_lr" \
                and not _same(current, value):
            problems.append((key, f"is {current!r} in the config but the arguments give {value!r} ({source}); "
                                  "make them agree or write \"auto\""))
    if problems:
        raise ConfigError(problems)
    return data


def _pair(args: Any) -> Any:
    beta1, beta2 = getattr(args, "adam_beta1", _MISSING), getattr(args, "adam_beta2", _MISSING)
    return _MISSING if _MISSING in (beta1, beta2) else [beta1, beta2]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def _locate(data: dict, key: str) -> tuple[dict | None, str]:
    *path, leaf = key.split(".")
    holder: Any = data
    for part in path:
        holder = holder.get(part) if isinstance(holder, dict) else None
        if holder is None:
            return None, leaf
    return (holder if isinstance(holder, dict) else None), leaf


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value
