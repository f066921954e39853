# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.zero.offload_config``."""

from ds_zero import (
    OffloadDeviceEnum,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OffloadStateTypeEnum,
)
from ds_zero import OffloadOptimizerConfig as DeepSpeedZeroOffloadOptimizerConfig
from ds_zero import OffloadParamConfig as DeepSpeedZeroOffloadParamConfig

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "OffloadDeviceEnum", "OffloadOptimizerConfig", "OffloadParamConfig",
           "OffloadStateTypeEnum"]
