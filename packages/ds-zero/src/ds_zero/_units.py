"""Stage 3's plan: which parameters form a fetch unit and which modules gather which units (see
`_stage3`), and the tensors in a module's output (where backward's gathers are hooked)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ._leaf import apply_zero_leaf_module_config, z3_leaf_module


def plan_units(model: nn.Module, params: list[nn.Parameter], leaf_config: Any = None
               ) -> tuple[list[tuple[str, list[int]]], list[tuple[nn.Module, list[int]]]]:
    """The units (a name and parameter indices each) and the hooked modules (each with the units of
    every parameter below it), for ``params`` (the trainable parameters, in the model's order). A module
    flagged as a leaf (`_leaf`; ``leaf_config``: ``zero_optimization.leaf_module``, applied first) is one
    unit with everything below it, whether it owns a parameter directly or not."""
    apply_zero_leaf_module_config(model, leaf_config)
    index = {id(p): i for i, p in enumerate(params)}
    units: list[tuple[str, list[int]]] = []
    unit_of: dict[int, int] = {}
    holders: list[tuple[nn.Module, list[int]]] = []  # (module, parameter indices below it)
    seen: set[int] = set()

    def claim(name: str, members: list[int]) -> None:
        new = [i for i in dict.fromkeys(members) if i not in unit_of]
        if new:
            for i in new:
                unit_of[i] = len(units)
            units.append((name, new))

    root = [index[id(p)] for p in model.parameters(recurse=False) if id(p) in index]
    claim("<root>", root)
    if root:
        holders.append((model, root))

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            direct = [p for p in child.parameters(recurse=False) if id(p) in index]
            leaf = z3_leaf_module(child)
            if direct or (leaf and any(id(p) in index for p in child.parameters())):
                members = [index[id(p)] for p in child.parameters() if id(p) in index]
                claim(prefix + name, members)
                holders.append((child, members))
                if leaf:  # DeepSpeed's mark of a leaf's parameters
                    for p in child.parameters():
                        p.ds_z3_leaf_module = child
            else:
                walk(child, f"{prefix}{name}.")

    walk(model, "")
    hooked = [(module, list(dict.fromkeys(unit_of[i] for i in members))) for module, members in holders]
    return units, hooked


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's output (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif hasattr(value, "to_tuple"):  # Hugging Face ModelOutput
        yield from tensors_in(value.to_tuple())
