"""The counting mode: a ``TorchFunctionMode`` that sees every torch function, functional and tensor
operation a model calls, runs it, and adds its flops to the innermost module being executed.

Nothing of torch is patched: the mode is pushed on torch's (thread-local) mode stack when the
outermost profiled module starts its forward and popped when it ends, even when it raises. Ops
are counted at the level the model calls them (``F.scaled_dot_product_attention``, ``nn.LSTM``'s
``torch.lstm``), so a count does not depend on the kernel the device picks.

While the mode handles a call it is off torch's stack (torch's rule), so the ops *inside* a
torch function are never seen twice; it also means that a Python-level torch function the table
does not know is opaque. The table therefore covers the Python-level functions that compute
(``F.multi_head_attention_forward``, ``F.interpolate``, ``torch.einsum``, the losses, ...).
"""

from __future__ import annotations

import logging

import torch
from torch.overrides import TorchFunctionMode

from ._registry import COUNTERS

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(func, error: Exception) -> None:
    name = getattr(func, "__qualname__", None) or repr(func)
    name = name.replace("_VariableFunctionsClass.", "torch.").replace("TensorBase.", "Tensor.")
    if name not in _warned:
        _warned.add(name)
        logger.warning("ds_profiler: cannot count a call of %s (%s: %s); it is counted as 0 flops",
                       name, type(error).__name__, error)


class Frame:
    """One module call on the stack: what it has counted so far."""

    __slots__ = ("child_flops", "child_macs", "counting", "record", "self_flops", "self_macs", "start")

    def __init__(self, record, counting: bool, start) -> None:
        self.record = record
        self.counting = counting
        self.start = start
        self.self_flops = 0
        self.self_macs = 0
        self.child_flops = 0
        self.child_macs = 0


class CountingMode(TorchFunctionMode):
    """Counts into ``stack[-1]`` (a :class:`Frame`); the profiler's hooks push and pop the frames."""

    def __init__(self, stack: list[Frame]) -> None:
        super().__init__()
        self._stack = stack
        self.active = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        counter = COUNTERS.get(func)
        if counter is None:
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        stack = self._stack
        if stack:
            frame = stack[-1]
            if frame.counting:
                try:
                    flops, macs = counter(out, args, kwargs)
                except Exception as error:  # a call form the formula does not know: say so, run on
                    _warn_once(func, error)
                    return out
                frame.self_flops += flops
                frame.self_macs += macs
        return out

    def enter(self) -> None:
        self.__enter__()
        self.active = True

    def leave(self) -> None:
        """Leave torch's mode stack, also when a mode pushed after ours was never popped."""
        if not self.active:
            return
        self.active = False
        depth = torch._C._len_torch_function_stack()
        if not any(torch._C._get_function_stack_at(i) is self for i in range(depth)):
            return
        while torch._C._len_torch_function_stack() > 0:
            if torch._C._pop_torch_function_stack() is self:
                return
