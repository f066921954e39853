"""DeepSpeed's ``deepspeed.runtime.fp16.loss_scaler`` is ds-zero's loss-scaler objects."""

from ds_zero import CreateLossScaler, DynamicLossScaler, LossScaler, LossScalerBase

# DeepSpeed's module constants: the keys of CreateLossScaler's dynamic_loss_args
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"

__all__ = ["CONSECUTIVE_HYSTERESIS", "DELAYED_SHIFT", "INITIAL_LOSS_SCALE", "MIN_LOSS_SCALE", "SCALE_WINDOW",
           "CreateLossScaler", "DynamicLossScaler", "LossScaler", "LossScalerBase"]
