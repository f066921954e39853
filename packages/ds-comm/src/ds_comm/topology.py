"""3D topology (pipe × data × model) and the model-parallel unit (``mpu``) built on it.

`ProcessTopology` is pure arithmetic (no processes): ranks are laid out row-major over the axes,
the last axis varying fastest, as in DeepSpeed. `Grid` creates one process group per line along
each axis (every rank creates every group, in the same order, as torch.distributed requires) and
answers the ``mpu`` questions of the seeds.
"""

from __future__ import annotations

import itertools
from collections import namedtuple

from .distributed import _require, get_rank, new_group


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
