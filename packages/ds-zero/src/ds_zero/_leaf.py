"""ZeRO-3 leaf modules (DeepSpeed's ``deepspeed.utils.z3_leaf_module``): a module flagged as a leaf is one
fetch unit with everything below it, gathered when its forward starts, and its children get no hooks.

A Mixture-of-Experts block routes each batch to some experts only, and to different ones on different
ranks: with one unit per expert the ranks would ask for different parameters (stage 3's path check stops
them); as a leaf, every rank gathers the whole block. Experts a rank did not use get no gradient in its
backward and count as zero (``ignore_unused_parameters``, the default). Also useful for a module made of
very many tiny ones (fewer hooks). Flags are read when `ZeroOptimizer` (or `ZeroInference`) lays out the
model at stage 3: set them before.

The flag is DeepSpeed's attribute ``_z3_leaf`` on the module (code that sets it by hand, as DeepSpeed's own does,
keeps working); only `z3_leaf_module` reads it and only `set_z3_leaf_module` writes it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)
_FLAG = "_z3_leaf"  # DeepSpeed's name for the flag on a module


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is flagged as a leaf."""
    return bool(getattr(model, _FLAG, False))


def z3_leaf_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to a leaf module stage 3 laid out."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` flagged as leaves."""
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Flag ``model`` as a leaf (``flag`` True) or not."""
    setattr(model, _FLAG, flag)


def _qualified(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _set_by_class(model: nn.Module, classes: Any, flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    classes = list(classes) if isinstance(classes, (list, tuple)) else classes
    if not isinstance(classes, list) or not all(isinstance(c, (type, str)) for c in classes):
        raise ValueError(f"leaf_module_classes must be a list of module classes or class names, got {classes!r}")
    matched = []
    for module in model.modules():
        for wanted in classes:
            if (isinstance(wanted, type) and isinstance(module, wanted)) or \
                    (isinstance(wanted, str) and wanted in (type(module).__name__, _qualified(module))):
                set_z3_leaf_module(module, flag)
                matched.append(module)
                break
    if not matched and raise_if_not_found:
        raise ValueError(f"no module of the classes {classes} in the model ({type(model).__name__})")
    return matched


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Any, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Flag every module of ``model`` that is an instance of one of ``leaf_module_classes`` (classes, or
    class names plain or with their module path) as a leaf; the modules flagged."""
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Any, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Undo `set_z3_leaf_modules` for those classes."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules named (as in ``named_modules()``); the modules flagged and the names not found."""
    by_name = dict(model.named_modules())
    matched, missing = [], []
    for name in module_names:
        if name in by_name:
            set_z3_leaf_module(by_name[name], flag)
            matched.append(by_name[name])
        else:
            missing.append(name)
    if missing and raise_if_not_found:
        raise ValueError(f"no modules named {missing} in the model ({type(model).__name__})")
    return matched, missing


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: list[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules whose ``named_modules()`` name ends with one of the suffixes; the modules flagged
    and the suffixes that matched none."""
    matched: dict[int, nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        hits = [module for name, module in model.named_modules() if name.endswith(suffix)]
        for module in hits:
            set_z3_leaf_module(module, flag)
            matched.setdefault(id(module), module)
        if not hits:
            missing.append(suffix)
    if missing and raise_if_not_found:
        raise ValueError(f"no modules whose names end with {missing} in the model ({type(model).__name__})")
    return list(matched.values()), missing


def apply_zero_leaf_module_config(model: nn.Module, leaf_config: Any) -> list[nn.Module]:
    """``zero_optimization.leaf_module``: flag its classes, names and name suffixes (DeepSpeed's defaults:
    the Mixtral, Qwen2-MoE and Qwen3-MoE sparse blocks of Transformers); names or suffixes that match nothing
    are logged. The modules flagged."""
    if leaf_config is None:
        return []
    matched: dict[int, nn.Module] = {}
    for module in _set_by_class(model, leaf_config.classes, True, raise_if_not_found=False):
        matched.setdefault(id(module), module)
    named, missing_names = set_z3_leaf_modules_by_name(model, leaf_config.names, raise_if_not_found=False)
    suffixed, missing_suffixes = set_z3_leaf_modules_by_suffix(model, leaf_config.name_suffixes,
                                                               raise_if_not_found=False)
    for module in [*named, *suffixed]:
        matched.setdefault(id(module), module)
    if missing_names or missing_suffixes:
        logger.warning("zero_optimization.leaf_module: no module named %s, none ending with %s", missing_names,
                       missing_suffixes)
    return list(matched.values())
