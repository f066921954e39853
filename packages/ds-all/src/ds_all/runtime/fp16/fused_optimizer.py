# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.fp16.fused_optimizer``: ``FP16_Optimizer``, true of an engine's optimizer at
stage 0 in fp16 over a fused Adam (ds-zero's `ZeroOptimizer`; see ``ds_all._optimizer_kinds``)."""

from ..._optimizer_kinds import FP16_Optimizer

__all__ = ["FP16_Optimizer"]
