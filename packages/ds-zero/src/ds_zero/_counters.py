"""`LoopCounters`: where a `ZeroOptimizer` stands in its training loop.

The micro-steps counted (they decide the accumulation boundary, and a checkpoint restores them), the steps an
overflow skipped, the boundary set by hand (DeepSpeed's ``set_gradient_accumulation_boundary``), whether the last
``step()`` was a boundary's (``zero_grad`` zeroes only then) and whether the optimizer was closed. The optimizer
holds one and hands it to what reads or restores these (`ZeroInternals`: the checkpoint and state access), so
nothing reads them out of the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class UpdateBoundaries(Protocol):
    """What decides the boundary instead of the count (ZenFlow: its own update interval, `_zenflow`)."""

    def is_update_boundary(self, micro_step: int) -> bool: ...


@dataclass
class LoopCounters:
    """See the module docstring. Plain fields: the optimizer and `ZeroInternals` read and set them."""

    micro_step: int = 0  # micro-steps counted since the start (or since the accumulation length changed)
    skipped_steps: int = 0  # boundary steps skipped for an overflow
    boundary_override: bool | None = None  # set_gradient_accumulation_boundary's; None: counted
    last_step_was_boundary: bool = True  # zero_grad zeroes only after a boundary's step
    closed: bool = False

    def is_boundary(self, accumulation_steps: int, boundaries: UpdateBoundaries | None = None) -> bool:
        """Whether the current micro-step ends an accumulation: the boundary set by hand, else ``boundaries``'
        (ZenFlow's), else every ``accumulation_steps``-th micro-step."""
        if self.boundary_override is not None:
            return self.boundary_override
        if boundaries is not None:
            return boundaries.is_update_boundary(self.micro_step)
        return (self.micro_step + 1) % accumulation_steps == 0

    def override_boundary(self, is_boundary: bool | None) -> None:
        """`ZeroOptimizer.set_gradient_accumulation_boundary`: True, False, or None to count again."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise ValueError(f"set_gradient_accumulation_boundary: is_boundary must be True, False or None, got "
                             f"{is_boundary!r}")
        self.boundary_override = is_boundary

    def count(self, boundary: bool) -> None:
        """A ``step()`` call: one micro-step more, ending an accumulation or not."""
        self.micro_step += 1
        self.last_step_was_boundary = boundary

    def restore(self, micro_step: int, skipped_steps: int) -> None:
        """The counters a rank's state (`ZeroOptimizer.load_state_dict`) saved."""
        self.micro_step, self.skipped_steps = int(micro_step), int(skipped_steps)

    def check_open(self, method: str) -> None:
        """A RuntimeError naming ``method`` once the optimizer was closed."""
        if self.closed:
            raise RuntimeError(f"ZeroOptimizer.{method}: this optimizer was closed")
