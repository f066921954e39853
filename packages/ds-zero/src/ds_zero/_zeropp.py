"""ZeRO++ (arXiv 2306.10209; DeepSpeed's ``zero_quantized_weights``, ``zero_hpz_partition_size``,
``zero_quantized_gradients``) at stage 3, as the parts the policy picks; the stage code calls them and has no
branch of its own for them.

* `ZeroPlusPlus`: the keys as one run uses them (off below stage 3, as DeepSpeed ignores them there).
* `UnitGathers`: how `Stage3` gathers a unit for the forward and backward.
  - exact: one all-gather over ZeRO's group (the default);
  - **qwZ**: each rank's shard as int8 blocks with a float32 scale per block (`ds_comm.quantized_all_gather`):
    a quarter of an fp32 gather's bytes, half of a bf16 one's;
  - **hpZ**: a forward gather (with autograd on: a backward will follow) also keeps this rank's
    ``1/zero_hpz_partition_size`` of the unit (the *secondary partition*, over groups of consecutive ranks,
    DeepSpeed's ``_create_zero_param_parallel_group``); the backward gathers the unit from those copies inside
    its group, so with the group inside a node no backward gather crosses the node boundary. The copies are
    dropped at the end of each backward and at each step, so they never hold values older than the shards.
  GatheredParameters, the 16-bit export, checkpoints and ``safe_get_*`` read exact values: a gather outside the
  forward/backward is exact, and a unit still gathered by qwZ is gathered exactly again for them (`exact`).
* **qgZ** (`QuantizedReduction`): the gradient reduce-scatter as DeepSpeed's ``all_to_all_quant_reduce``,
  int4 blocks inside the node and across (`ds_comm.quantized_reduce_scatter` over `ds_comm.HierarchicalGroups`).
* **MixZ++** (`QuantizedShards`, ``zero_quantized_nontrainable_weights``): the frozen parameters' partition stored
  as int8 blocks, and their units gathered as qwZ gathers (the stored blocks are what travels).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

import ds_comm
import ds_ops

from ._model import version

logger = logging.getLogger(__name__)

WEIGHT_BITS = 8  # qwZ: DeepSpeed's int8 weights
GRADIENT_BITS = 4  # qgZ: DeepSpeed's int4 gradients (inside the node and across)
STORE_GROUP = 2048  # MixZ++: elements per scale of the stored frozen weights


@dataclass(frozen=True)
class ZeroPlusPlus:
    """The ZeRO++ keys of one run, as they apply (all off below stage 3)."""

    quantized_weights: bool = False
    hpz_partition_size: int = 1  # 1: off
    quantized_gradients: bool = False
    quantized_nontrainable_weights: bool = False

    @property
    def on(self) -> bool:
        return self.quantized_weights or self.hpz_partition_size > 1 or self.quantized_gradients or \
            self.quantized_nontrainable_weights


def zeropp_of(config: Any, shard_params: bool) -> ZeroPlusPlus:
    """``zero_optimization``'s ZeRO++ keys for a run that partitions its parameters (``shard_params``) or not.
    DeepSpeed reads them at stage 3 only and ignores them below: so does this, saying so once."""
    keys = ZeroPlusPlus(bool(config.zero_quantized_weights), max(1, int(config.zero_hpz_partition_size)),
                        bool(config.zero_quantized_gradients), bool(config.zero_quantized_nontrainable_weights))
    if shard_params or not keys.on:
        return keys
    logger.warning("zero_optimization: the ZeRO++ keys (zero_quantized_weights, zero_hpz_partition_size, "
                   "zero_quantized_gradients, zero_quantized_nontrainable_weights) apply at stage 3 only; at stage "
                   "%s they change nothing (as in DeepSpeed)", config.stage)
    return ZeroPlusPlus()


def _whole_world(group: Any, what: str) -> None:
    if ds_comm.get_world_size(group) != ds_comm.get_world_size():
        raise NotImplementedError(f"zero_optimization.{what} over a data-parallel group smaller than the world "
                                  f"({ds_comm.get_world_size(group)} of {ds_comm.get_world_size()} ranks: tensor, "
                                  f"pipeline or sequence parallelism) is not implemented in ds-zero {version()}")


class UnitGathers:
    """How one `Stage3` gathers its units (see the module docstring): ``quantized`` (qwZ) and ``hpz`` ranks per
    secondary partition (hpZ; 1: off), over ZeRO's ``group``. Creating it with hpZ makes the hpZ groups: a
    collective, in the same order on every rank."""

    def __init__(self, group: Any, *, quantized: bool = False, hpz: int = 1):
        self.group, self.quantized = group, quantized
        world, rank = ds_comm.get_world_size(group), ds_comm.get_rank(group)
        self.hpz = min(hpz, world)  # DeepSpeed: min(zero_hpz_partition_size, world size)
        self.hpz_group: Any = None
        self.hpz_rank = 0
        if quantized:
            _whole_world(group, "zero_quantized_weights")
        if self.hpz > 1:
            _whole_world(group, "zero_hpz_partition_size")
            if world % self.hpz:
                raise ValueError(f"zero_optimization.zero_hpz_partition_size {hpz} must divide the world size "
                                 f"{world} (DeepSpeed's rule: each secondary partition is hpz consecutive ranks)")
            for first in range(0, world, self.hpz):  # every rank creates every group, in order
                members = list(range(first, first + self.hpz))
                made = ds_comm.new_group(members)
                if rank in members:
                    self.hpz_group, self.hpz_rank = made, rank - first
            per_node = ds_comm.node_topology().ranks_per_node
            if per_node % self.hpz:
                logger.warning("zero_optimization.zero_hpz_partition_size %d does not divide the %d ranks per node: "
                               "the backward's gathers cross nodes (set it to the ranks per node)", self.hpz, per_node)
        self._secondary: dict[int, torch.Tensor] = {}  # unit index -> this rank's 1/hpz of the unit (hpZ)
        self._inexact: set[int] = set()  # units whose gathered buffer holds qwZ's dequantized values
        self._to_keep: set[int] = set()  # forward gathers in flight whose secondary copy `landed` keeps (hpZ)

    def start(self, index: int, full: torch.Tensor, source: torch.Tensor | None, phase: str | None) -> Any:
        """Issue unit ``index``'s gather into ``full`` (this rank's shard in its place, or ``source``): exact with
        ``phase`` None (outside the forward and backward), else ZeRO++'s way for "forward" or "backward"."""
        if phase == "backward" and index in self._secondary:
            self._inexact.discard(index)  # (as exact as the forward it was kept from)
            return ds_comm.all_gather_bucket(full, self._secondary[index], group=self.hpz_group, async_op=True)
        world, rank = ds_comm.get_world_size(self.group), ds_comm.get_rank(self.group)
        if phase is not None and self.quantized:
            shard = full.view(world, -1)[rank] if source is None else source
            work = ds_comm.quantized_all_gather(shard, self.group, bits=WEIGHT_BITS, out=full, async_op=True)
            self._inexact.add(index)
        else:
            work = ds_comm.all_gather_bucket(full, source, group=self.group, async_op=True)
            self._inexact.discard(index)
        if phase == "forward" and self.hpz > 1 and torch.is_grad_enabled():
            self._to_keep.add(index)
        return work

    def scratch(self, numel: int, dtype: torch.dtype, device: torch.device, index: int, phase: str | None) -> Any:
        """The collective `start` would issue, into scratch buffers (the path guard squares up ranks with it)."""
        if phase == "backward" and index in self._secondary:
            return ds_comm.all_gather_bucket(torch.empty(numel, dtype=dtype, device=device), group=self.hpz_group,
                                             async_op=True)
        if phase is not None and self.quantized:
            shard = torch.zeros(numel // ds_comm.get_world_size(self.group), dtype=dtype, device=device)
            return ds_comm.quantized_all_gather(shard, self.group, bits=WEIGHT_BITS, async_op=True)
        return ds_comm.all_gather_bucket(torch.empty(numel, dtype=dtype, device=device), group=self.group,
                                         async_op=True)

    def landed(self, index: int, full: torch.Tensor) -> None:
        """Unit ``index``'s gather into ``full`` completed (its parameters point at it now): a forward's keeps
        this rank's secondary copy."""
        if index not in self._to_keep:
            return
        self._to_keep.discard(index)
        part = full.view(self.hpz, -1)[self.hpz_rank]
        kept = self._secondary.get(index)
        if kept is None or kept.numel() != part.numel():
            self._secondary[index] = part.clone()
        else:
            kept.copy_(part)

    def exact(self, index: int) -> bool:
        """Whether unit ``index``'s gathered buffer (if any) holds the shards' exact values."""
        return index not in self._inexact

    def forget(self, index: int | None = None) -> None:
        """Drop the secondary copies (of unit ``index``; of every unit by default): the shards changed, or the
        backward that needed them is over."""
        if index is None:
            self._secondary.clear()
        else:
            self._secondary.pop(index, None)

    def released(self, index: int) -> None:
        self._inexact.discard(index)
        self._to_keep.discard(index)

    def secondary_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._secondary.values())


class _Pending:
    """The handle of a reduction running on `QuantizedReduction`'s thread."""

    def __init__(self, future: Future):
        self._future = future

    def wait(self, *_: Any, **__: Any) -> bool:
        self._future.result()  # (its exception, if it raised)
        return True

    def is_completed(self) -> bool:
        return self._future.done()


class QuantizedReduction:
    """qgZ: ``start(buffer, out)`` reduce-scatters (sums) ``buffer`` into ``out`` as DeepSpeed's
    ``all_to_all_quant_reduce`` (int4 inside the node, int4 across; the node layout from the launcher's
    ``LOCAL_WORLD_SIZE``/``LOCAL_SIZE``) and returns a handle. The reductions run one after another on a thread
    of their own (the quantization kernels and gloo release the GIL), in the order started, which is the same
    on every rank: the backward goes on meanwhile, as it does beside a plain reduce-scatter. Creating it creates
    the hierarchical groups: a collective."""

    def __init__(self, group: Any):
        _whole_world(group, "zero_quantized_gradients")
        self.groups = ds_comm.HierarchicalGroups()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_zero-qgZ")

    def __call__(self, buffer: torch.Tensor, out: torch.Tensor) -> Any:
        return _Pending(self._thread.submit(self._reduce, buffer, out))

    def _reduce(self, buffer: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(ds_comm.quantized_reduce_scatter(buffer, self.groups, op=ds_comm.ReduceOp.SUM, bits=GRADIENT_BITS))

    def close(self) -> None:
        self._thread.shutdown(wait=True)


class _Read:
    """A read of `QuantizedShards` (done when it is returned)."""

    def wait(self) -> None:
        return None


class QuantizedShards:
    """MixZ++ (``zero_quantized_nontrainable_weights``): a partition of frozen parameters stored as int8 blocks
    with a float32 scale per `STORE_GROUP` elements, each unit's shard on its own, never held in its float
    dtype. `Stage3` reads and writes it as it does ZeRO-Infinity's shards on NVMe (``shards=``): a read
    dequantizes, a write (a `GatheredParameters` modification, a load) quantizes again. The frozen weights
    *are* the quantized values from then on, as in DeepSpeed."""

    location = "quantized"  # (``ds_tensor.final_location``)

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._shards: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # start -> (q, scales, numel)

    def write_params(self, start: int, values: torch.Tensor) -> None:
        """Elements ``[start, start + len(values))``: a whole shard, quantized."""
        q, scales = ds_ops.quantize_blockwise(values.detach().reshape(-1).cpu(), STORE_GROUP, WEIGHT_BITS)
        self._shards[start] = (q, scales, values.numel())

    def start_read_params(self, start: int, n: int, out: torch.Tensor | None = None,
                          fetch: bool = True) -> tuple[Any, torch.Tensor]:
        """The shard written at ``start`` (``n`` elements), dequantized into ``out`` (the store's dtype)."""
        q, scales, numel = self._shards[start]
        if numel != n:
            raise ValueError(f"QuantizedShards: the shard at {start} holds {numel} elements, not {n}")
        out = torch.empty(n, dtype=self.dtype, device="cpu") if out is None else out  # (the host: a staging read)
        ds_ops.dequantize_blockwise(q, scales, n, STORE_GROUP, WEIGHT_BITS, out=out)
        return _Read(), out

    def nbytes(self) -> int:
        return sum(q.numel() * q.element_size() + s.numel() * s.element_size() for q, s, _ in self._shards.values())
