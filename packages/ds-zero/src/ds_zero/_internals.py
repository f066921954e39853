"""`ZeroInternals`: the one way ds-zero's other modules reach into a `ZeroOptimizer` (``zero.internals``).

The checkpoint (`_checkpoint`, `_checkpoint_tp`), DeepSpeed's state-access API (`_state_access`) and
ZeRO-Infinity's step (`_offload.nvme_step`) read the optimizer's public attributes (``model``,
``optimizer``, ``layout``, ``policy``, ``group``, ``rank``, ``world_size``, ``device``, ``scaler``,
``checkpoint_names``, ``skipped_steps``) and, for what it keeps to itself, this protocol; never its private
attributes. Offsets of a parameter's pieces are in its `ParamRecord` (``records``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from torch import nn

    from ._frozen import FrozenShards
    from ._nvme import NvmeOptimizer
    from ._offload import HostOffload
    from ._precision import AdamRecipe
    from ._records import ParamRecords


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
