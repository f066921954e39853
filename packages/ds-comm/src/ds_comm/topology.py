"""3D topology (pipe × data × model) and the model-parallel unit (``mpu``) built on it.

`ProcessTopology` is pure arithmetic (no processes): ranks are laid out row-major over the axes,
the last axis varying fastest, as in DeepSpeed. `Grid` creates one process group per line along
each axis (every rank creates every group, in the same order, as torch.distributed requires) and
answers the ``mpu`` questions of the seeds.
"""

from __future__ import annotations

import itertools
import os
from collections import namedtuple
from dataclasses import dataclass

from .distributed import _require, get_rank, get_world_size, new_group


class ProcessTopology:
    def __init__(self, axes: list[str], dims: list[int]):
        if len(axes) != len(dims) or not axes:
            raise ValueError(f"ProcessTopology: axes and dims must be non-empty and of the same length, got {axes}, {dims}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names must be unique, got {axes}")
        if any(not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"ProcessTopology: every dim must be a positive integer, got {dims}")
        self.axes, self.dims = list(axes), list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self._coords = [self.ProcessCoord(*c) for c in itertools.product(*(range(d) for d in self.dims))]
        self._ranks = {c: r for r, c in enumerate(self._coords)}

    def world_size(self) -> int:
        return len(self._coords)

    def get_dim(self, axis: str) -> int:
        return self.dims[self._axis(axis)]

    def get_rank(self, **coords) -> int:
        if sorted(coords) != sorted(self.axes):
            raise ValueError(f"ProcessTopology.get_rank: give every axis {self.axes}, got {sorted(coords)}")
        for axis, value in coords.items():
            if not 0 <= value < self.get_dim(axis):
                raise ValueError(f"ProcessTopology.get_rank: {axis}={value} is outside 0..{self.get_dim(axis) - 1}")
        return self._ranks[self.ProcessCoord(**coords)]

    def get_coord(self, rank: int):
        if not 0 <= rank < self.world_size():
            raise ValueError(f"ProcessTopology.get_coord: rank {rank} is outside 0..{self.world_size() - 1}")
        return self._coords[rank]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate on ``axis`` is ``idx``."""
        a = self._axis(axis)
        return [r for r, c in enumerate(self._coords) if c[a] == idx]

    def filter_match(self, **filter_kwargs) -> list[int]:
        return [r for r, c in enumerate(self._coords) if all(getattr(c, k) == v for k, v in filter_kwargs.items())]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The lines along ``axis``: groups of ranks that differ only in that coordinate."""
        a = self._axis(axis)
        lines: dict[tuple, list[int]] = {}
        for r, c in enumerate(self._coords):
            lines.setdefault(tuple(v for i, v in enumerate(c) if i != a), []).append(r)
        return list(lines.values())

    def _axis(self, axis: str) -> int:
        if axis not in self.axes:
            raise ValueError(f"ProcessTopology: unknown axis {axis!r}; axes: {self.axes}")
        return self.axes.index(axis)


class PipeDataParallelTopology(ProcessTopology):
    """DeepSpeed's pipe × data topology (``deepspeed.runtime.pipe.topology``): ``num_pp`` stages,
    ``num_dp`` data-parallel replicas, neighbouring ranks in one data-parallel group."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """DeepSpeed's pipe × data × model topology (model-parallel ranks neighbours)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


class Grid:
    """The ``mpu`` of a topology with axes among ``pipe``, ``data``, ``model`` (missing ones count 1)."""

    def __init__(self, topology: ProcessTopology):
        _require("Grid")
        self.topology = topology
        self.rank = get_rank()
        self.coord = topology.get_coord(self.rank)
        self._groups = {}
        for axis in topology.axes:
            for ranks in topology.get_axis_comm_lists(axis):
                group = new_group(ranks)  # every rank creates every group, in the same order
                if self.rank in ranks:
                    self._groups[axis] = (group, ranks)

    def _rank_on(self, axis: str) -> int:
        return getattr(self.coord, axis) if axis in self.topology.axes else 0

    def _size_of(self, axis: str) -> int:
        return self.topology.get_dim(axis) if axis in self.topology.axes else 1

    def _group_of(self, axis: str):
        return self._groups[axis][0] if axis in self._groups else None

    # model parallel
    def get_model_parallel_rank(self) -> int:
        return self._rank_on("model")

    def get_model_parallel_world_size(self) -> int:
        return self._size_of("model")

    def get_model_parallel_group(self):
        return self._group_of("model")

    # data parallel
    def get_data_parallel_rank(self) -> int:
        return self._rank_on("data")

    def get_data_parallel_world_size(self) -> int:
        return self._size_of("data")

    def get_data_parallel_group(self):
        return self._group_of("data")

    # pipeline parallel
    def get_pipe_parallel_rank(self) -> int:
        return self._rank_on("pipe")

    def get_pipe_parallel_world_size(self) -> int:
        return self._size_of("pipe")

    def get_pipe_parallel_group(self):
        return self._group_of("pipe")

    def get_stage_id(self) -> int:
        return self.get_pipe_parallel_rank()

    def is_first_stage(self) -> bool:
        return self.get_stage_id() == 0

    def is_last_stage(self) -> bool:
        return self.get_stage_id() == self.get_pipe_parallel_world_size() - 1

    def stage_to_global(self, stage_id: int) -> int:
        """The global rank of ``stage_id`` with this rank's other coordinates."""
        coords = self.coord._asdict()
        coords["pipe"] = stage_id
        return self.topology.get_rank(**coords)

    def get_prev_stage_rank(self) -> int | None:
        return None if self.is_first_stage() else self.stage_to_global(self.get_stage_id() - 1)

    def get_next_stage_rank(self) -> int | None:
        return None if self.is_last_stage() else self.stage_to_global(self.get_stage_id() + 1)


# ---- nodes ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeTopology:
    """Which ranks share a node: ``world_size`` ranks, ``ranks_per_node`` consecutive ranks a node
    (the layout of ds-launch, torchrun and DeepSpeed's launcher: rank = node * ranks_per_node +
    local rank). Pure arithmetic; `node_topology` reads it from the launcher's environment."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self):
        for name in ("world_size", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NodeTopology: {name} must be a positive integer, got {value!r}")
        if self.world_size % self.ranks_per_node:
            raise ValueError(f"NodeTopology: ranks_per_node ({self.ranks_per_node}) must divide the world size "
                             f"({self.world_size})")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """The ranks of one node, in order (an intra-node group)."""
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def peer_ranks(self, local_rank: int) -> list[int]:
        """The ranks with this local rank on every node, in node order (an inter-node group)."""
        return [node * self.ranks_per_node + local_rank for node in range(self.num_nodes)]

    def off_node_peers(self, rank: int, ranks: list[int]) -> int:
        """How many of ``ranks`` are on another node than ``rank``."""
        return sum(self.node_of(r) != self.node_of(rank) for r in ranks)


def node_topology(world_size: int | None = None, ranks_per_node: int | None = None) -> NodeTopology:
    """The node layout of this job: ``ranks_per_node`` if given, else the launcher's
    ``LOCAL_WORLD_SIZE`` (ds-launch, torchrun), else ``LOCAL_SIZE`` (DeepSpeed's launcher, what its CPU
    accelerator counts), else one node. So ``LOCAL_WORLD_SIZE=2`` on 4 ranks is 2 nodes × 2 ranks on
    one machine. ``world_size``: the process group's, by default."""
    if world_size is None:
        _require("node_topology")
        world_size = get_world_size()
    if ranks_per_node is None:
        for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            text = os.environ.get(name, "").strip()
            if text:
                if not text.isdigit() or int(text) < 1:
                    raise ValueError(f"node_topology: {name} must be a positive integer, got {text!r}")
                ranks_per_node = int(text)
                break
        else:
            ranks_per_node = world_size
    if world_size % ranks_per_node:
        raise ValueError(f"node_topology: {ranks_per_node} ranks per node (LOCAL_WORLD_SIZE / LOCAL_SIZE or the "
                         f"argument) must divide the world size {world_size}")
    return NodeTopology(world_size, ranks_per_node)


class HierarchicalGroups:
    """The process groups of a two-level collective on a `NodeTopology`: ``intra`` (this rank's node)
    and ``inter`` (the ranks with this rank's local rank on every node, in node order), as DeepSpeed's
    ``local_<node>`` and ``global_<local rank>`` all-to-all groups. Every rank creates every group in
    the same order (torch.distributed requires it), so every rank must construct this together."""

    def __init__(self, topology: NodeTopology | None = None):
        _require("HierarchicalGroups")
        self.topology = node_topology() if topology is None else topology
        self.rank = get_rank()
        topo = self.topology
        self.intra = self.inter = None
        for node in range(topo.num_nodes):
            group = new_group(topo.node_ranks(node))
            if node == topo.node_of(self.rank):
                self.intra = group
        for local in range(topo.ranks_per_node):
            group = new_group(topo.peer_ranks(local))
            if local == topo.local_rank_of(self.rank):
                self.inter = group
