"""`ZeroInternals`: the one way ds-zero's other modules reach into a `ZeroOptimizer` (``zero.internals``).

The checkpoint (`_checkpoint`, `_checkpoint_tp`), DeepSpeed's state-access API (`_state_access`) and
ZeRO-Infinity's step (`_offload.nvme_step`) read the optimizer's public attributes (``model``,
``optimizer``, ``layout``, ``policy``, ``group``, ``rank``, ``world_size``, ``device``, ``scaler``,
``checkpoint_names``, ``skipped_steps``) and, for what it keeps to itself, this protocol; never its private
attributes. Offsets of a parameter's pieces are in its `ParamRecord` (``records``). `OptimizerInternals` is the
protocol over the optimizer's parts, handed to it explicitly: its `ZeroBuffers`, `GradientReducer` and
`LoopCounters`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from torch import nn

    from ._buffers import ZeroBuffers
    from ._counters import LoopCounters
    from ._frozen import FrozenShards
    from ._nvme import NvmeOptimizer
    from ._offload import HostOffload
    from ._precision import AdamRecipe
    from ._records import ParamRecords
    from ._reduction import GradientReducer


class ZeroInternals(Protocol):
    """What a `ZeroOptimizer` keeps to itself, as its checkpoint and state access read (and restore) it."""

    @property
    def records(self) -> ParamRecords:
        """One `ParamRecord` per trained parameter, in the layout's order."""

    @property
    def step_tensors(self) -> list[nn.Parameter]:
        """The tensors the optimizer steps (one per run: its states are keyed by them)."""

    @property
    def flat(self) -> torch.Tensor:
        """The flat parameters (16-bit with fp16/bf16; this rank's partition at stage 3; storage-less when the
        parameters are on NVMe)."""

    @property
    def master(self) -> torch.Tensor:
        """The master weights in RAM, laid out as the records' ``in_master`` say: the float32 copy, or the flat
        parameters where they are the master (float32 training, bf16 master weights)."""

    @property
    def has_master_copy(self) -> bool:
        """Whether ``master`` is a copy beside the flat parameters (which then follow it after a load)."""

    @property
    def nvme(self) -> NvmeOptimizer | None:
        """ZeRO-Infinity's files (Adam's states, the master copy, the parameters), or None."""

    @property
    def host(self) -> HostOffload | None:
        """ZeRO-Offload's host buffers, or None."""

    @property
    def frozen(self) -> FrozenShards | None:
        """Stage 3's partitioned frozen parameters, or None."""

    @property
    def recipe(self) -> AdamRecipe | None:
        """The fused Adam step's recipe (16-bit models, offload), or None."""

    @property
    def replica_groups(self) -> dict[tuple[int, ...], Any]:
        """Subgroups some parameters are replicated over (`_replicas`), by their ranks."""

    @property
    def closed(self) -> bool: ...

    @property
    def accumulated(self) -> bool:
        """A backward reduced (or accumulated) gradients since the last boundary's step."""

    @property
    def boundary_reduced(self) -> bool:
        """The boundary's backward reduced every bucket."""

    @property
    def grad_buffer(self) -> torch.Tensor | None:
        """The flat gradients of stages 0-1 (every ``.grad`` a view of it), or None."""

    @property
    def grad_partition(self) -> torch.Tensor | None:
        """This rank's reduced gradient partition (stages 1-3), or None."""

    micro_step: int  # micro-steps counted (a checkpoint restores it)

    def wait_reductions(self) -> None:
        """Complete the gradient reductions in flight."""

    def gradients_changed(self) -> None:
        """Gradients were set by hand: what was copied of them (to the host) is copied again at the step."""

    def master_loaded(self) -> None:
        """The master weights were written (a load): the 16-bit parameters follow them and every rank's
        parameters are refreshed (a collective)."""

    def next_reduction(self) -> None:
        """A 1-bit optimizer's (loaded) step decides whether the next gradients are averaged."""


class OptimizerInternals:
    """`ZeroInternals` over one `ZeroOptimizer`'s parts (a view: it reads their current state). ``next_reduction``:
    the optimizer's own (a 1-bit optimizer decides whether the next gradients are averaged)."""

    __slots__ = ("_buffers", "_counters", "_next_reduction", "_reducer")

    def __init__(self, *, buffers: ZeroBuffers, reducer: GradientReducer, counters: LoopCounters,
                 next_reduction: Callable[[], None]):
        self._buffers, self._reducer, self._counters = buffers, reducer, counters
        self._next_reduction = next_reduction

    records = property(lambda self: self._buffers.records)
    step_tensors = property(lambda self: self._buffers.step_params)
    flat = property(lambda self: self._buffers.flat)
    nvme = property(lambda self: self._buffers.nvme)
    host = property(lambda self: self._buffers.host)
    frozen = property(lambda self: self._buffers.frozen)
    recipe = property(lambda self: self._buffers.recipe)
    replica_groups = property(lambda self: self._buffers.replica_groups)
    closed = property(lambda self: self._counters.closed)
    accumulated = property(lambda self: self._reducer.accumulated)
    boundary_reduced = property(lambda self: self._reducer.boundary_reduced)
    grad_buffer = property(lambda self: self._buffers.grads)
    grad_partition = property(lambda self: self._buffers.partition)

    @property
    def master(self) -> torch.Tensor:
        return self._buffers.flat if self._buffers.master is None else self._buffers.master

    @property
    def has_master_copy(self) -> bool:
        return self._buffers.master is not None

    @property
    def micro_step(self) -> int:
        return self._counters.micro_step

    @micro_step.setter
    def micro_step(self, value: int) -> None:
        self._counters.micro_step = int(value)

    def wait_reductions(self) -> None:
        self._reducer.finish_in_flight()

    def gradients_changed(self) -> None:
        if self._buffers.host is not None:
            self._buffers.host.forget_downloads()

    def master_loaded(self) -> None:
        self._buffers.master_loaded()

    def next_reduction(self) -> None:
        self._next_reduction()
