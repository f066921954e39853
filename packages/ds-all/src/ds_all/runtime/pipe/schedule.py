"""DeepSpeed's ``deepspeed.runtime.pipe.schedule``: the schedules and their instructions (ds-pipe)."""

from ds_pipe import (
    BackwardPass,
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

__all__ = ["BackwardPass", "ForwardPass", "InferenceSchedule", "LoadMicroBatch", "OptimizerStep", "PipeInstruction",
           "RecvActivation", "RecvGrad", "ReduceGrads", "ReduceTiedGrads", "SendActivation", "SendGrad",
           "TrainSchedule"]
