"""The profile as data: a tree of per-module records, for programs and monitors."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModuleProfile:
    """What one module did during the profiled forward calls.

    ``flops``, ``macs`` and ``duration`` are inclusive: the module's own functional/tensor ops plus
    everything its submodules did while it ran. ``self_flops``/``self_macs`` are the part done
    outside any submodule (the difference between a parent and the sum of its children).
    A module instance registered under two parents appears under both with the same numbers.
    """

    name: str  #: qualified name as in ``model.named_modules()``; ``""`` for the model itself
    type_name: str  #: class name, e.g. ``"Linear"``
    depth: int  #: 0 for the model, 1 for its children, ...
    params: int  #: parameters of the module and its submodules (each tensor once)
    trainable_params: int  #: of those, the ones with ``requires_grad``
    flops: int  #: floating-point operations of the forward calls
    macs: int  #: multiply-accumulates of the forward calls (matmuls, convolutions, attention, RNNs)
    self_flops: int
    self_macs: int
    duration: float  #: seconds spent in the module's forward calls
    calls: int  #: number of forward calls
    ignored: bool = False  #: excluded from counting (``ignore_list``); params still shown
    extra_repr: str = ""  #: the module's own ``extra_repr()``, e.g. ``in_features=8, ...``
    children: tuple[ModuleProfile, ...] = field(default_factory=tuple)

    def walk(self) -> Iterator[ModuleProfile]:
        """This record and every descendant, depth first, in module order."""
        yield self
        for child in self.children:
            yield from child.walk()

    def find(self, name: str) -> ModuleProfile:
        """The record of the module with qualified name ``name``."""
        for record in self.walk():
            if record.name == name:
                return record
        names = [r.name for r in self.walk()]
        raise KeyError(f"no module named {name!r} in the profile; names are {names[:20]}"
                       f"{' ...' if len(names) > 20 else ''}")

    @property
    def flops_per_second(self) -> float:
        return self.flops / self.duration if self.duration > 0 else 0.0

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (children nested)."""
        return {
            "name": self.name, "type": self.type_name, "depth": self.depth, "params": self.params,
            "trainable_params": self.trainable_params, "flops": self.flops, "macs": self.macs,
            "self_flops": self.self_flops, "self_macs": self.self_macs, "duration": self.duration,
            "calls": self.calls, "ignored": self.ignored, "extra_repr": self.extra_repr,
            "children": [child.to_dict() for child in self.children],
        }
