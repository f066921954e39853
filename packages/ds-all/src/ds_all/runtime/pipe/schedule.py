# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.pipe.schedule``: the schedules and their instructions (ds-pipe)."""

from ds_pipe import (
    BackwardPass,
    DataParallelSchedule,
    ForwardPass,
    InferenceSchedule,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
)
from ds_pipe.schedule import PipeSchedule

__all__ = ["BackwardPass", "DataParallelSchedule", "ForwardPass", "InferenceSchedule",
           "LoadMicroBatch", "OptimizerStep", "PipeInstruction", "PipeSchedule", "RecvActivation",
           "RecvGrad", "ReduceGrads", "ReduceTiedGrads", "SendActivation", "SendGrad",
           "TrainSchedule"]
