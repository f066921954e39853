"""`ModelParallelUnit`: the ``mpu`` object DeepSpeed's engine and Megatron-DeepSpeed ask for groups.

Ranks are laid out on ds-comm's `ProcessTopology` with axes ``pipe, data, sequence, tensor``, the
tensor axis varying fastest (tensor-parallel ranks are neighbours, on one node where possible),
then sequence, data, pipe (Megatron-DeepSpeed's order). Every rank creates every group, in the
same order, as torch.distributed requires.

The questions it answers (DeepSpeed's ``deepspeed.utils.groups``/``bwc`` and its
``PipelineParallelGrid``, Megatron's ``parallel_state``):

* ``get_model_parallel_*``, ``get_tensor_model_parallel_*``, ``get_slice_parallel_*``: the tensor axis.
* ``get_data_parallel_*``: the data axis only (ranks with the same model slice and sequence shard).
* ``get_sequence_parallel_*``: the sequence axis (Ulysses).
* ``get_sequence_data_parallel_*``: data x sequence, the ranks ZeRO partitions and reduces over with
  Ulysses (as DeepSpeed's ``groups._get_sequence_data_parallel_group``).
* ``get_pipeline_model_parallel_*`` / ``get_pipe_parallel_*``: the pipe axis; stage helpers.

Like DeepSpeed's ``PipelineParallelGrid`` it has no ``initialize_sequence_parallel`` method: DeepSpeed
takes an mpu with one for a sequence-only mpu and then ignores its model-parallel and data groups.
"""

from __future__ import annotations

import ds_comm
from ds_comm import ProcessTopology

_AXES = ("pipe", "data", "sequence", "tensor")
_ALIASES = {"model": "tensor"}  # DeepSpeed's PipeModelDataParallelTopology calls the tensor axis "model"


def _positive(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"ModelParallelUnit: {name} must be a positive int, got {value!r}")
    return value


class ModelParallelUnit:
    """Process groups for pipe x data x sequence x tensor parallelism over all ranks of the default
    group. The data-parallel size is what is left: ``world / (tensor * pipeline * sequence)``.

    ``topology``: instead of the sizes, an existing `ds_comm.ProcessTopology` whose axes are among
    ``pipe, data, sequence, tensor`` (``model`` read as ``tensor``, so a ds-pipe
    ``PipeModelDataParallelTopology`` gives the same groups as its ``PipelineModule``); a missing axis
    has size 1."""

    def __init__(self, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 sequence_parallel_size: int = 1, *, topology: ProcessTopology | None = None):
        if not ds_comm.is_initialized():
            raise RuntimeError("ModelParallelUnit: the default process group is not initialised; call "
                               "ds_comm.init_distributed() (or torch.distributed.init_process_group) first")
        world = ds_comm.get_world_size()
        if topology is not None:
            if (tensor_parallel_size, pipeline_parallel_size, sequence_parallel_size) != (1, 1, 1):
                raise ValueError("ModelParallelUnit: give either the parallel sizes or topology, not both")
            self._topo, self._names = self._from_topology(topology, world)
        else:
            tp = _positive("tensor_parallel_size", tensor_parallel_size)
            pp = _positive("pipeline_parallel_size", pipeline_parallel_size)
            sp = _positive("sequence_parallel_size", sequence_parallel_size)
            if world % (tp * pp * sp):
                raise ValueError(f"ModelParallelUnit: the world size {world} is not divisible by tensor_parallel_size "
                                 f"({tp}) x pipeline_parallel_size ({pp}) x sequence_parallel_size ({sp}) = "
                                 f"{tp * pp * sp}")
            self._topo = ProcessTopology(list(_AXES), [pp, world // (tp * pp * sp), sp, tp])
            self._names = {axis: axis for axis in _AXES}
        self.global_rank = ds_comm.get_rank()
        self._coord = self._topo.get_coord(self.global_rank)
        self._groups: dict[str, tuple[object, list[int]]] = {}
        for axis in _AXES:  # an axis the topology lacks: one group per rank
            self._build(axis, self._lines_varying({axis}))
        self._build("sequence_data", self._lines_varying({"data", "sequence"}))

    # ---- construction -------------------------------------------------------------------------------
    @staticmethod
    def _from_topology(topology: ProcessTopology, world: int):
        if not isinstance(topology, ProcessTopology):
            raise ValueError(f"ModelParallelUnit: topology must be a ds_comm.ProcessTopology, got "
                             f"{type(topology).__name__}")
        names = {}
        for axis in topology.axes:
            ours = _ALIASES.get(axis, axis)
            if ours not in _AXES or ours in names:
                raise ValueError(f"ModelParallelUnit: topology axis {axis!r} is not one of pipe, data, sequence, "
                                 f"tensor (or model), each once; axes: {topology.axes}")
            names[ours] = axis
        if topology.world_size() != world:
            raise ValueError(f"ModelParallelUnit: the topology has {topology.world_size()} ranks but the world size "
                             f"is {world}")
        return topology, names

    def _lines_varying(self, axes: set[str]) -> list[list[int]]:
        """Groups of ranks that differ only in ``axes`` (those the topology has), in rank order."""
        fixed = [self._names[a] for a in _AXES if a in self._names and a not in axes]
        lines: dict[tuple, list[int]] = {}
        for rank in range(self._topo.world_size()):
            coord = self._topo.get_coord(rank)
            lines.setdefault(tuple(getattr(coord, a) for a in fixed), []).append(rank)
        return list(lines.values())

    def _build(self, name: str, lines: list[list[int]]) -> None:
        for ranks in lines:
            group = ds_comm.new_group(ranks)  # every rank creates every group, in the same order
            if self.global_rank in ranks:
                self._groups[name] = (group, ranks)

    def _ranks(self, name: str) -> list[int]:
        return list(self._groups[name][1])

    def _group(self, name: str):
        return self._groups[name][0]

    def _rank(self, name: str) -> int:
        return self._ranks(name).index(self.global_rank)

    def _size(self, name: str) -> int:
        return len(self._ranks(name))

    # ---- topology -----------------------------------------------------------------------------------
    def topology(self) -> ProcessTopology:
        """The rank layout (DeepSpeed's ``PipelineParallelGrid.topology()``)."""
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={self._size(a)}" for a in _AXES)
        return f"ModelParallelUnit({sizes}, rank={self.global_rank})"

    # ---- tensor (model) parallel --------------------------------------------------------------------
    def get_tensor_model_parallel_rank(self) -> int:
        return self._rank("tensor")

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._size("tensor")

    def get_tensor_model_parallel_group(self):
        return self._group("tensor")

    def get_tensor_model_parallel_group_ranks(self) -> list[int]:
        return self._ranks("tensor")

    def get_tensor_model_parallel_src_rank(self) -> int:
        """The global rank of tensor-parallel rank 0 of this rank's group (what DeepSpeed broadcasts from)."""
        return self._ranks("tensor")[0]

    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_src_rank = get_tensor_model_parallel_src_rank
    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group

    # ---- data parallel ------------------------------------------------------------------------------
    def get_data_parallel_rank(self) -> int:
        return self._rank("data")

    def get_data_parallel_world_size(self) -> int:
        return self._size("data")

    def get_data_parallel_group(self):
        return self._group("data")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self._ranks("data")

    def get_data_parallel_src_rank(self) -> int:
        return self._ranks("data")[0]

    # ---- sequence parallel (Ulysses) ----------------------------------------------------------------
    def get_sequence_parallel_rank(self) -> int:
        return self._rank("sequence")

    def get_sequence_parallel_world_size(self) -> int:
        return self._size("sequence")

    def get_sequence_parallel_group(self):
        return self._group("sequence")

    def get_sequence_parallel_group_ranks(self) -> list[int]:
        return self._ranks("sequence")

    def get_sequence_data_parallel_rank(self) -> int:
        return self._rank("sequence_data")

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._size("sequence_data")

    def get_sequence_data_parallel_group(self):
        return self._group("sequence_data")

    def get_sequence_data_parallel_group_ranks(self) -> list[int]:
        return self._ranks("sequence_data")

    # ---- pipeline parallel --------------------------------------------------------------------------
    def get_pipeline_model_parallel_rank(self) -> int:
        return self._rank("pipe")

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._size("pipe")

    def get_pipeline_model_parallel_group(self):
        return self._group("pipe")

    def get_pipeline_model_parallel_group_ranks(self) -> list[int]:
        return self._ranks("pipe")

    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_stage_id = get_pipeline_model_parallel_rank

    def is_pipeline_first_stage(self) -> bool:
        return self.get_stage_id() == 0

    def is_pipeline_last_stage(self) -> bool:
        return self.get_stage_id() == self.get_pipeline_model_parallel_world_size() - 1

    is_first_stage = is_pipeline_first_stage
    is_last_stage = is_pipeline_last_stage

    def stage_to_global(self, stage_id: int) -> int:
        """The global rank of pipeline stage ``stage_id`` with this rank's other coordinates."""
        stages = self.get_pipeline_model_parallel_world_size()
        if not isinstance(stage_id, int) or not 0 <= stage_id < stages:
            raise ValueError(f"ModelParallelUnit.stage_to_global: stage_id must be in 0..{stages - 1}, got {stage_id!r}")
        return self._ranks("pipe")[stage_id]

    def get_pipeline_model_parallel_next_rank(self) -> int:
        """The global rank of the next stage (wrapping around, as Megatron's)."""
        ranks = self._ranks("pipe")
        return ranks[(self._rank("pipe") + 1) % len(ranks)]

    def get_pipeline_model_parallel_prev_rank(self) -> int:
        """The global rank of the previous stage (wrapping around, as Megatron's)."""
        ranks = self._ranks("pipe")
        return ranks[(self._rank("pipe") - 1) % len(ranks)]
