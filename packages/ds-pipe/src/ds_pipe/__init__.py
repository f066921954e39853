"""ds-pipe: pipeline parallelism.

`PipelineModule` cuts a list of layers (`LayerSpec`, `TiedLayerSpec`, modules, callables) into stages,
each rank building only its own; schedules (`TrainSchedule` 1F1B, `InferenceSchedule`,
`InterleavedSchedule`, `ZeroBubbleSchedule`) are pure instruction streams (`print_schedule` draws one);
`PipelineExecutor` runs a stage through them with p2p over ds-comm, its gradient reduction and optimizer
step being hooks; `PipelineParallelGrid` is a module's mpu (its topology's groups, tensor slicing
included); `PipelineConfig` is the ``pipeline`` config section.
"""

from ._executor import PipelineExecutor
from ._grid import PipelineParallelGrid
from ._module import LayerSpec, PipelineModule, TiedLayerSpec
from ._p2p import PeerFailed
from .config import PipelineConfig
from .schedule import (
    BackwardInput,
    BackwardPass,
    BackwardWeight,
    DataParallelSchedule,
    ForwardPass,
    InferenceSchedule,
    InterleavedSchedule,
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
    ZeroBubbleSchedule,
    print_schedule,
)

__version__ = "0.1.0"

__all__ = [
    "BackwardInput", "BackwardPass", "BackwardWeight", "DataParallelSchedule", "ForwardPass", "InferenceSchedule", "InterleavedSchedule",
    "LayerSpec", "LoadMicroBatch", "OptimizerStep", "PeerFailed", "PipeInstruction", "PipelineConfig",
    "PipelineExecutor", "PipelineModule", "PipelineParallelGrid", "RecvActivation", "RecvGrad", "ReduceGrads", "ReduceTiedGrads",
    "SendActivation", "SendGrad", "TiedLayerSpec", "TrainSchedule", "ZeroBubbleSchedule", "__version__",
    "print_schedule",
]
