"""`PipelineParallelGrid`: a `PipelineModule`'s mpu, ds-comm's `Grid` with DeepSpeed's pipeline questions.

ds-comm's `Grid` answers the ``model`` axis as the model-parallel one (tensor slicing: Megatron's
``get_model_parallel_*``, what ds-all's engine and activation checkpointing ask). A pipeline with
tensor-parallel stages (a ``pipe × data × model`` topology, DeepSpeed's Megatron examples) also needs what
DeepSpeed's ``PipelineParallelGrid`` answers: the tensor-slicing group under its newer names
(``get_tensor_model_parallel_*``, ``get_slice_parallel_*``), the pipeline's (``get_pipeline_model_parallel_*``),
and the ranks holding the other parts of one replica of the model, every stage and every slice
(``get_pipe_model_parallel_group``: DeepSpeed's ``ds_model_proc_group``), over which a gradient norm adds up.
"""

from __future__ import annotations

import ds_comm


class PipelineParallelGrid(ds_comm.Grid):
    """The mpu of a `PipelineModule` (``module.mpu()``): every group of ds-comm's `Grid`, and one group per
    data-parallel index holding every stage and tensor slice of that replica (every rank creates every
    group, in the same order)."""

    def __init__(self, topology):
        super().__init__(topology)
        data = topology.get_dim("data") if "data" in topology.axes else 1
        if self._size_of("model") == 1:  # one slice: the replica's ranks are the pipeline's
            self._replica = self._groups.get("pipe", (None, [self.rank]))
            return
        self._replica = (None, [self.rank])
        for index in range(data):
            ranks = sorted(topology.filter_match(data=index)) if "data" in topology.axes else \
                list(range(topology.world_size()))
            group = ds_comm.new_group(ranks)
            if self.rank in ranks:
                self._replica = (group, ranks)

    # tensor slicing (DeepSpeed's and Megatron's newer names for the model axis)
    def get_tensor_model_parallel_rank(self) -> int:
        return self.get_model_parallel_rank()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.get_model_parallel_world_size()

    def get_tensor_model_parallel_group(self):
        return self.get_model_parallel_group()

    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group

    # the pipeline (Megatron's names)
    def get_pipeline_model_parallel_rank(self) -> int:
        return self.get_pipe_parallel_rank()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.get_pipe_parallel_world_size()

    def get_pipeline_model_parallel_group(self):
        return self.get_pipe_parallel_group()

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._groups["data"][1]) if "data" in self._groups else [self.rank]

    # one replica of the model: every stage, every slice
    def get_pipe_model_parallel_group(self):
        """The ranks holding one data-parallel replica's parts (stages × tensor slices); None with one rank."""
        return self._replica[0]

    def get_pipe_model_parallel_world_size(self) -> int:
        return len(self._replica[1])

    def get_pipe_model_parallel_rank(self) -> int:
        return self._replica[1].index(self.rank)
