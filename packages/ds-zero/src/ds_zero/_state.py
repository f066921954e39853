"""What `ZeroOptimizer` holds, saved and restored: the model's whole ``state_dict()``, the bytes held by
kind, and a rank's own ``state_dict()``/``load_state_dict()`` (same rank, same layout; other world
sizes and stages go through `_checkpoint`). A mixin: `ZeroOptimizer` owns the state."""

from __future__ import annotations

from typing import Any

import torch

from ._filling import refuse_with_nvme
from ._model import short
from ._sharded import full_state_dict


class State:
    """The state half of `ZeroOptimizer` (see the module docstring)."""

    def full_state_dict(self, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()`` with every parameter whole, as copies in its training dtype
        (stage 3 gathers one unit at a time: every rank calls it). With ``rank0_only`` the other ranks
        get ``{}`` and hold no copy (``stage3_gather_16bit_weights_on_model_save``)."""
        frozen = self._frozen.stage3 if self._frozen is not None else None  # stage 3's partitioned frozen ones
        return full_state_dict(self.model, [self._stage3, frozen], keep=not rank0_only or self.rank == 0)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the model's states, by kind: ``params`` (the flat parameters,
        16-bit with fp16/bf16; at stage 3 this rank's partition plus the units gathered now),
        ``grads`` (full at stages 0-1, this rank's partition at stages 2-3, plus
        float32 copies for a non-Adam optimizer of a 16-bit model), ``master`` (the float32 copy of
        what this rank steps; none in float32 training, where the parameters are the master, nor with
        ``bf16.bf16_master_weights_and_grads``, where the bf16 parameters are),
        ``optimizer`` (the optimizer's state tensors), and ``buffers`` (reusable reduction buffers; at stage 3
        also released gather buffers kept for reuse)."""
        def size(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t) and t.dim() > 0)

        grads = [self._grads, self._partition, self._master_grads]
        gathered = self._stage3.held_bytes() if self._stage3 is not None else 0  # stage 3: whole units now
        partition = self._flat.untyped_storage().nbytes()  # 0 when the parameters are on NVMe
        partition += self._frozen.nbytes() if self._frozen is not None else 0  # stage 3's frozen parameters
        out = {"params": partition + gathered, "grads": size(grads), "master": size([self._master]),
               "optimizer": size(t for state in self.optimizer.state.values() for t in state.values()),
               "buffers": size([*self._reducer.bucket_buffers, *self._reducer.received]) +
               (self._stage3.pooled_bytes() if self._stage3 is not None else 0)}
        if self._nvme is not None:  # RAM: its chunk buffers; the states and master copy are on disk
            out["optimizer"] += self._nvme.memory_bytes()
            out["nvme"] = self._nvme.offloaded_bytes
        return out

    def _identity(self) -> dict[str, Any]:
        return {"zero_stage": self.stage, "world_size": self.world_size, "rank": self.rank, "precision": self.precision,
                "shapes": [tuple(s.shape) for s in self.layout.slots], "bucket_size": self.layout.bucket_size}

    def state_dict(self) -> dict[str, Any]:
        """This rank's part: the optimizer's state over its shards, the float32 master copy (16-bit
        models), the loss scaler (fp16), what it was laid out for, and at stage 3 this rank's shards of
        the parameters (the model's own ``state_dict()`` holds empty tensors there)."""
        refuse_with_nvme(self._nvme, "state_dict")
        state = {**self._identity(), "micro_step": self._micro_step, "optimizer": self.optimizer.state_dict(),
                 "skipped_steps": self.skipped_steps}
        if self.policy.shard_params:
            state["partition"] = self._flat.clone()
        if self._master is not None:
            state["master"] = self._master.clone()
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a `state_dict` saved by the same rank of the same layout (loading on another world
        size or stage is the checkpoint issue's reshaping). Every rank calls it: with a master copy
        the parameters are set from it and gathered (at stage 3, from the shards in the state)."""
        refuse_with_nvme(self._nvme, "load_state_dict")
        for key, value in self._identity().items():
            if key not in state:
                raise ValueError(f"ZeroOptimizer.load_state_dict: the state has no {key!r}")
            saved = [tuple(s) for s in state[key]] if key == "shapes" else state[key]
            if saved != value:
                raise ValueError(f"ZeroOptimizer.load_state_dict: saved with {key}={short(saved)}, this optimizer "
                                 f"has {key}={short(value)}")
        self.optimizer.load_state_dict(state["optimizer"])
        self._next_reduction()
        if self.policy.shard_params:
            self._flat.copy_(state["partition"])
        self._micro_step = int(state["micro_step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scaler is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        if self._master is not None:
            self._master.copy_(state["master"])
            for copy, tensor in zip(self._copies, self._step_params, strict=True):
                copy.copy_(tensor.detach())
        if self._master is not None or self.policy.shard_params:
            self._refresh_parameters()
