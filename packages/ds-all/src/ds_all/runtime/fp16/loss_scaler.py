# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.fp16.loss_scaler`` is ds-zero's loss-scaler objects."""

from ds_zero import CreateLossScaler, DynamicLossScaler, LossScaler, LossScalerBase

INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"

__all__ = ["CONSECUTIVE_HYSTERESIS", "DELAYED_SHIFT", "INITIAL_LOSS_SCALE", "MIN_LOSS_SCALE",
           "SCALE_WINDOW", "CreateLossScaler", "DynamicLossScaler", "LossScaler", "LossScalerBase"]
