# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.zero.stage3``: ``DeepSpeedZeroOptimizer_Stage3``, true of an engine's
optimizer at ZeRO stage 3 (ds-zero's `ZeroOptimizer`; see ``ds_all._optimizer_kinds``)."""

from ..._optimizer_kinds import DeepSpeedZeroOptimizer_Stage3

__all__ = ["DeepSpeedZeroOptimizer_Stage3"]
