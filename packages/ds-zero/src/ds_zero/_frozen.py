"""Frozen parameters (``requires_grad=False``) under `ZeroOptimizer` at stage 3: partitioned as DeepSpeed
partitions them.

ZeRO steps only the trainable parameters; at stages 0-2 a frozen parameter stays whole on every rank
(as in DeepSpeed, which keeps it out of its flat groups). At stage 3 DeepSpeed partitions every
parameter, frozen or not; so does `FrozenShards`: the frozen parameters get a flat partition of their
own, laid out and filled by `ShardedParams` as `ZeroInference`'s model without an optimizer (one unit per module
that owns frozen parameters, each rank keeping one shard of each), and a `Stage3` of their own gathers
a module's frozen units around its forward (and backward, where autograd needs them) and releases them
after, on the model's device as the trainable ones (the partition on the host with ``offload_param``). Nothing here has gradients: the units are never reduced, only gathered.

The two `Stage3`s of one model share autograd's saved-tensor hooks (only the innermost pair applies):
the frozen one's, pushed after the trainable one's, saves a view of either's gathered buffer as a
reference to its unit, so releasing frees the memory and backward gathers it again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._sharded import ShardedParams
from ._stage3 import Stage3
from ._zeropp import QuantizedShards, UnitGathers


def partitioned_frozen(model: nn.Module, partitioned: bool, dtype: torch.dtype,
                       managed: set[int]) -> list[nn.Parameter]:
    """The parameters stage 3 partitions (``partitioned``) besides the trainable ones: every frozen
    floating-point parameter of the training dtype (after the 16-bit cast); none below stage 3."""
    if not partitioned:
        return []
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if id(p) in seen or id(p) in managed or p.requires_grad:
            continue
        seen.add(id(p))
        if p.dtype == dtype or (p.is_floating_point() and hasattr(p, "ds_init_shard")):
            out.append(p)
    return out


@dataclass(frozen=True)
class _PeerSaved:
    """A saved tensor the trainable `Stage3` packed (a reference to one of its units)."""

    inner: Any


class _FrozenStage3(Stage3):
    """`Stage3` over the frozen units: also packs the trainable `Stage3`'s saved views (its hooks are
    the innermost), and in backward releases the frozen unit it gathered last when it gathers another
    (there is no gradient reduction to release it; a unit released too early is gathered again when
    autograd unpacks it)."""

    peer: Stage3 | None = None
    _last_backward: int | None = None

    def pack_saved(self, tensor: torch.Tensor) -> Any:
        saved = super().pack_saved(tensor)
        if saved is tensor and self.peer is not None:
            other = self.peer.pack_saved(tensor)
            return tensor if other is tensor else _PeerSaved(other)
        return saved

    def unpack_saved(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _PeerSaved):
            return self.peer.unpack_saved(saved.inner)
        return super().unpack_saved(saved)

    def backward_request(self, unit) -> None:
        last = self._last_backward
        if last is not None and last != unit.index:
            self.release(self.units[last])
        self._last_backward = unit.index
        super().backward_request(unit)

    def after_backward(self) -> None:
        self._last_backward = None
        super().after_backward()


class FrozenShards:
    """The frozen parameters of a stage-3 model, partitioned (see the module docstring)."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], config: Any, group: Any, dtype: torch.dtype,
                 peer: Stage3, quantized: bool = False):
        self.params, self.group, self.dtype = params, group, dtype
        self.device = peer.device  # the model's (the partition: there, or on the host with offload_param)
        self._sharded = ShardedParams(model, params, config=config, group=group, dtype=dtype, device=self.device)
        self.world_size, self.rank, self.layout = self._sharded.world_size, self._sharded.rank, self._sharded.layout
        # MixZ++ (``quantized``): the shards are kept as int8 blocks (`_zeropp.QuantizedShards`), never in float
        self.store = QuantizedShards(dtype) if quantized else None
        if self.store is not None:
            self._sharded.partition = torch.empty(0, dtype=dtype, device=self._sharded.partition.device)
        self._partition = self._sharded.partition
        # (whole or built under Init: this rank's shards, then released)
        self._sharded.fill(on_disk=None if self.store is None else self.store.write_params)
        self.stage3 = self._sharded.attach(stage3_class=_FrozenStage3, shards=self.store,
                                           gatherer=UnitGathers(group, quantized=quantized))
        self.stage3.peer = peer

    def whole(self) -> dict[int, torch.Tensor]:
        """Every frozen parameter's whole value, a copy (a collective: one unit gathered at a time)."""
        return self._sharded.whole()

    def load_whole(self, values: dict[int, torch.Tensor]) -> None:
        """Set frozen parameters from whole values (``{id(parameter): value}``, the same on every rank):
        this rank's shards are written, and units gathered now take the new values."""
        self._sharded.load_whole(values)

    def nbytes(self) -> int:
        stored = self.store.nbytes() if self.store is not None else self._partition.numel() * \
            self._partition.element_size()
        return stored + self.stage3.held_bytes()
