# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.zero.stage_1_and_2``: ``DeepSpeedZeroOptimizer``, true of an engine's
optimizer at ZeRO stage 1 or 2 (ds-zero's `ZeroOptimizer`; see ``ds_all._optimizer_kinds``)."""

from ..._optimizer_kinds import DeepSpeedZeroOptimizer

__all__ = ["DeepSpeedZeroOptimizer"]
