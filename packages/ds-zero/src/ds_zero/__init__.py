"""ds-zero: the Zero Redundancy Optimizer for a plain PyTorch loop.

    zero = ds_zero.ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={"lr": 1e-3},
                                 config={"stage": 2}, bf16={"enabled": True})
    zero.backward(loss); zero.step(); zero.zero_grad()

Stages 0-3 in float32, fp16 (loss scaling) and bf16 with a float32 master copy (or none: bf16 master
weights, stages 1-3), CPU offload of the optimizer (ZeRO-Offload); at stage 3 `Init` builds a model
already partitioned, `GatheredParameters` makes parameters whole for a while and `ZeroInference`
partitions a model for evaluation without an optimizer; optimizer states and parameters on NVMe
(ZeRO-Infinity). `OneBitAdam`, `ZeroOneAdam` and `OneBitLamb` (stage 0) send 1-bit compressed messages after warm-up.
`DynamicLossScaler`, `LossScaler` and `CreateLossScaler` are DeepSpeed's loss-scaler objects for loops that
scale an fp16 loss by hand. `safe_get_full_fp32_param`, `safe_get_full_grad`, `safe_get_full_optimizer_state` and
their `safe_set_*`/`*_local_*` forms (DeepSpeed's ``deepspeed.utils``) read and write one parameter's state.
"""

from ._checkpoint import load_zero_checkpoint, read_zero_metadata, save_zero_checkpoint
from ._deepspeed_format import is_deepspeed_checkpoint, load_deepspeed_checkpoint
from ._errors import ZeRORuntimeException
from ._estimate import (
                        estimate_zero2_model_states_mem_needs_all_cold,
                        estimate_zero2_model_states_mem_needs_all_live,
                        estimate_zero3_model_states_mem_needs_all_cold,
                        estimate_zero3_model_states_mem_needs_all_live,
                        estimate_zero_model_states_mem_needs,
)
from ._export import (
                        convert_zero_checkpoint_to_fp32_state_dict,
                        convert_zero_checkpoint_to_state_dict,
                        get_fp32_state_dict_from_zero_checkpoint,
                        load_state_dict_from_zero_checkpoint,
)
from ._inference import ZeroInference
from ._init import (
                        GatheredParameters,
                        Init,
                        register_external_parameter,
                        unregister_external_parameter,
)
from ._leaf import (
                        apply_zero_leaf_module_config,
                        get_z3_leaf_modules,
                        set_z3_leaf_module,
                        set_z3_leaf_modules,
                        set_z3_leaf_modules_by_name,
                        set_z3_leaf_modules_by_suffix,
                        unset_z3_leaf_modules,
                        z3_leaf_module,
                        z3_leaf_parameter,
)
from ._loss_scaler import CreateLossScaler, DynamicLossScaler, LossScaler, LossScalerBase
from ._optimizer import ZeroOptimizer
from ._params import ZeroParamStatus
from ._recovery import recovery_main, write_recovery_scripts
from ._state_access import (
                        safe_get_full_fp32_param,
                        safe_get_full_grad,
                        safe_get_full_optimizer_state,
                        safe_get_local_fp32_param,
                        safe_get_local_grad,
                        safe_get_local_optimizer_state,
                        safe_set_full_fp32_param,
                        safe_set_full_grad,
                        safe_set_full_optimizer_state,
                        safe_set_local_fp32_param,
                        safe_set_local_grad,
                        safe_set_local_optimizer_state,
                        safe_update_full_grad_vectorized,
)
from .config import (
                        BF16Config,
                        FP16Config,
                        OffloadDeviceEnum,
                        OffloadOptimizerConfig,
                        OffloadParamConfig,
                        OffloadStateTypeEnum,
                        ZeroConfig,
)
from .onebit import OneBitAdam, OneBitLamb, ZeroOneAdam

__version__ = "0.1.0"


def __getattr__(name: str):
    # `SafeReader` subclasses torch.distributed.checkpoint's reader, and that import pulls in DTensor and sympy
    # (about 4 s): it loads on first use, so a process that imports ds_zero (each launched rank) does not pay it
    if name == "SafeReader":
        from ._storage import SafeReader

        return SafeReader
    raise AttributeError(f"module 'ds_zero' has no attribute {name!r}")

__all__ = ["BF16Config", "CreateLossScaler", "DynamicLossScaler", "FP16Config", "GatheredParameters", "Init",
           "LossScaler", "LossScalerBase", "OffloadDeviceEnum", "OffloadOptimizerConfig", "OffloadParamConfig",
           "OffloadStateTypeEnum", "OneBitAdam", "OneBitLamb", "ZeRORuntimeException", "ZeroConfig",
           "ZeroInference", "ZeroOneAdam", "ZeroOptimizer", "ZeroParamStatus", "__version__",
           "apply_zero_leaf_module_config", "convert_zero_checkpoint_to_fp32_state_dict",
           "convert_zero_checkpoint_to_state_dict", "estimate_zero2_model_states_mem_needs_all_cold",
           "estimate_zero2_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs_all_cold",
           "estimate_zero3_model_states_mem_needs_all_live", "estimate_zero_model_states_mem_needs",
           "get_fp32_state_dict_from_zero_checkpoint", "get_z3_leaf_modules", "is_deepspeed_checkpoint",
           "load_deepspeed_checkpoint", "load_state_dict_from_zero_checkpoint", "load_zero_checkpoint",
           "read_zero_metadata", "recovery_main", "register_external_parameter", "safe_get_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state", "safe_get_local_fp32_param", "safe_get_local_grad",
           "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
           "safe_set_full_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
           "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized", "save_zero_checkpoint",
           "set_z3_leaf_module", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "unregister_external_parameter", "unset_z3_leaf_modules",
           "write_recovery_scripts", "z3_leaf_module", "z3_leaf_parameter"]
