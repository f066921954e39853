"""`build_optimizer`: the optimizer a DeepSpeed config's ``optimizer`` section asks for, by DeepSpeed's rules."""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch
from ds_config import DEEPSPEED_KEYS, ConfigError, load_ds_config

import ds_ops
import ds_zero

from ._monitor_config import OptimizerConfig

logger = logging.getLogger(__name__)

ONE_BIT = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb"}
MUP = {"muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD"}
CONSUMED = ("torch_adam", "adam_w_mode")  # read by the Adam/AdamW rule, never passed on


def _problem(key: str, message: str) -> ConfigError:
    return ConfigError([(f"params.{key}" if key else "type", message)], "optimizer")


def _section(config: Any) -> OptimizerConfig | None:
    """The ``optimizer`` section of ``config``; None when a whole config has none."""
    if config is None or isinstance(config, OptimizerConfig):
        return config
    whole = config if isinstance(config, Mapping) else load_ds_config(config)
    is_section = bool(whole) and not set(whole) & DEEPSPEED_KEYS
    if not is_section and whole.get("optimizer") is None:
        strangers = [key for key in whole if key not in DEEPSPEED_KEYS]
        close = difflib.get_close_matches("optimizer", strangers, n=1, cutoff=0.75)
        if close:
            raise ConfigError([("", f"unknown section {close[0]!r}; did you mean 'optimizer'?")])
        return None
    return OptimizerConfig.from_section_or_ds_config(whole)


def _choose(name: str, params: dict[str, Any], offload: bool) -> tuple[type, dict[str, Any]]:
    """DeepSpeed's ``_configure_basic_optimizer``: the class for ``name`` and the keyword arguments it gets."""
    lower = name.lower()
    if lower in ("adam", "adamw"):
        if "adamw_mode" in params:  # CPUAdam's own spelling; the rule below sets it from adam_w_mode
            raise _problem("adamw_mode", "is set from DeepSpeed's key 'adam_w_mode'; write that instead")
        torch_adam = params.pop("torch_adam", False)
        adam_w_mode = params.pop("adam_w_mode", True)
        for key, value in (("torch_adam", torch_adam), ("adam_w_mode", adam_w_mode)):
            if not isinstance(value, bool):
                raise _problem(key, f"must be true or false, got {value!r}")
        decoupled = lower == "adamw" or adam_w_mode  # type AdamW is always AdamW, as in DeepSpeed
        if torch_adam:
            return (torch.optim.AdamW if decoupled else torch.optim.Adam), params
        if offload:
            return ds_ops.CPUAdam, {**params, "adamw_mode": decoupled}
        return ds_ops.FusedAdam, {**params, "adam_w_mode": decoupled}
    if lower == "lamb":
        return ds_ops.FusedLamb, params  # offloaded too: FusedLamb runs CPU tensors (as DeepSpeed builds it)
    if lower == "lion":
        return ds_ops.CPULion, params
    if lower == "adagrad":
        return (ds_ops.CPUAdagrad if offload else torch.optim.Adagrad), params
    if lower in ONE_BIT:
        if offload:
            raise _problem("", f"{ONE_BIT[lower]} steps on the model's own memory with ZeRO stage 0; "
                               "zero_optimization.offload_optimizer is for stages 1-3: remove it")
        return getattr(ds_zero, ONE_BIT[lower]), params
    if lower in MUP:
        try:
            return getattr(importlib.import_module("mup"), MUP[lower]), params
        except ImportError:
            raise _problem("", f"{MUP[lower]} needs the mup package (pip install mup)") from None
    return getattr(torch.optim, name), params  # OptimizerConfig admitted only torch.optim's class names


def optimizer_class(name: str, params: dict[str, Any], *, offload: bool) -> tuple[type, dict[str, Any]]:
    """The class DeepSpeed's rules build for optimizer type ``name`` and the keyword arguments it gets."""
    return _choose(name, dict(params), offload)


def _check_arguments(cls: type, kwargs: dict[str, Any]) -> None:
    """Every key a keyword of ``cls``'s constructor and every required one given, else ConfigError."""
    parameters = dict(inspect.signature(cls).parameters)
    parameters.pop(next(iter(parameters)))  # the parameters (or params) to optimize
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    accepted = [name for name, p in parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    problems = []
    for key in kwargs:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append((f"params.{key}", f"unknown parameter {key!r} of {cls.__name__}{hint} "
                                              f"Allowed: {', '.join(accepted)}"))
    for name in accepted:
        if parameters[name].default is inspect.Parameter.empty and name not in kwargs:
            problems.append((f"params.{name}", f"is required by {cls.__name__}"))
    if problems:
        raise ConfigError(problems, "optimizer")


def build_optimizer(config: Any, params: Any, *, offload: bool = False, bf16_states: bool = False):
    """The optimizer a DeepSpeed config asks for, over ``params`` (parameters or parameter groups); None when
    the config has no ``optimizer`` section.

    ``config`` is an `OptimizerConfig`, the ``optimizer`` section as a dict (``{"type": "AdamW", "params":
    {...}}``), a whole DeepSpeed config as a dict, or the path of a JSON file holding one. ``offload=True``
    (ZeRO's ``offload_optimizer``) picks the CPU optimizers, as DeepSpeed does. Adam/AdamW read and drop
    ``torch_adam`` and ``adam_w_mode``. ``bf16_states`` (``bf16.bf16_optimizer_states``): ds-ops' Adam keeps its
    moments in bfloat16, as DeepSpeed's engine arranges. Bad sections and parameters raise
    `ds_config.ConfigError` (a ValueError) naming the key and what the optimizer accepts.
    """
    section = _section(config)
    if section is None:
        return None
    kwargs = dict(section.params)
    autos = [key for key, value in kwargs.items() if isinstance(value, str) and value == "auto"]
    if autos:  # kept by the section as written (Config.resolve fills them in), never guessed here
        raise ConfigError([(f"params.{key}", "is 'auto', which an optimizer cannot resolve: resolve it first "
                                             "(ds_all.Config.resolve) or give a value") for key in autos], "optimizer")
    if "max_grad_norm" in kwargs:  # DeepSpeed refuses it for every type, FusedLamb's own argument included
        raise _problem("max_grad_norm", "is not an optimizer parameter in a DeepSpeed config; use the top-level "
                                        "'gradient_clipping'")
    cls, kwargs = _choose(section.type, kwargs, offload)
    if bf16_states and cls is ds_ops.CPUAdam:
        kwargs.setdefault("fp32_optimizer_states", False)
    elif bf16_states and cls is ds_ops.FusedAdam:
        kwargs.setdefault("state_dtype", torch.bfloat16)
    _check_arguments(cls, kwargs)
    optimizer = cls(params, **kwargs)
    logger.debug("built %s(%s) for optimizer type %s", cls.__name__, kwargs, section.type)
    return optimizer
