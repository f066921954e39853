# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.bf16_optimizer``. DeepSpeed trains bf16 at ZeRO stage 0 with its
``BF16_Optimizer`` and at stages 1-3 with its ZeRO optimizers; ds trains bf16 at every stage with
`ds_zero.ZeroOptimizer` (a float32 master copy unless ``bf16_master_weights_and_grads``), so
``BF16_Optimizer`` is that class: ``isinstance(engine.optimizer, BF16_Optimizer)`` holds for a bf16
engine at any stage (and for any ZeRO engine of ds, fp16 and float32 ones included)."""

from ds_zero import ZeroOptimizer as BF16_Optimizer

__all__ = ["BF16_Optimizer"]
