"""`DeepSpeedReader`: `torch.distributed.checkpoint`'s view of a DeepSpeed checkpoint (`_deepspeed_format`).

Its own module because subclassing DCP's `StorageReader` imports ``torch.distributed.checkpoint``, which
pulls in DTensor and sympy (about 4 s on this CPU): it is imported when a DeepSpeed checkpoint is loaded,
not with ds-zero.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.futures import Future

from ._deepspeed_format import DeepSpeedState


class DeepSpeedReader(StorageReader):
    """`torch.distributed.checkpoint`'s view of a DeepSpeed checkpoint: every entry one whole chunk,
    read from the tensors `read_deepspeed_checkpoint` assembled (no file is opened here)."""

    def __init__(self, state: DeepSpeedState):
        super().__init__()
        self.state = state
        self.tensors = state.entries()

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        entries = {}
        for key, t in self.tensors.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size([0] * t.dim()), sizes=t.shape)
            entries[key] = TensorStorageMetadata(TensorProperties(dtype=t.dtype), t.shape, [chunk])
        return Metadata(state_dict_metadata=entries)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Future:
        for request in plan.items:
            source = self.tensors[request.storage_index.fqn]
            for dim, (start, length) in enumerate(zip(request.storage_offsets, request.lengths, strict=True)):
                source = source.narrow(dim, start, length)
            target = planner.resolve_tensor(request).detach()
            if target.shape != source.shape:
                raise ValueError(f"{request.storage_index.fqn}: asked for {list(target.shape)}, the DeepSpeed "
                                 f"checkpoint holds {list(source.shape)}")
            target.copy_(source)
            planner.commit_tensor(request, target)
        done: Future = Future()
        done.set_result(None)
        return done
