"""ds-zero: the Zero Redundancy Optimizer for a plain PyTorch loop.

    zero = ds_zero.ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={"lr": 1e-3},
                                 config={"stage": 2})
    zero.backward(loss); zero.step(); zero.zero_grad()

Stages 0-2 in float32 today; mixed precision, offload and stage 3 are refused with a message until
they land (see the package README).
"""

from ._optimizer import ZeroOptimizer
from .config import BF16Config, FP16Config, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__version__ = "0.1.0"

__all__ = ["BF16Config", "FP16Config", "OffloadOptimizerConfig", "OffloadParamConfig", "ZeroConfig", "ZeroOptimizer",
           "__version__"]
