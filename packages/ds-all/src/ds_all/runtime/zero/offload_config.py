"""DeepSpeed's ``deepspeed.runtime.zero.offload_config``."""

from ds_zero import (
           OffloadDeviceEnum,
           OffloadOptimizerConfig,
           OffloadParamConfig,
           OffloadStateTypeEnum,
)

# DeepSpeed's names of the two section models
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig
DeepSpeedZeroOffloadParamConfig = OffloadParamConfig

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum",
           "OffloadOptimizerConfig", "OffloadParamConfig", "OffloadStateTypeEnum"]
