"""ds-ops: the native ops of ds. C++17 + pybind11 kernels built just in time by the op builder
(no torch headers: Python passes pointers, C++ releases the GIL), and the optimizers made of them.

    import ds_ops
    opt = ds_ops.CPUAdam(model.parameters(), lr=1e-3)            # the optimizer of ZeRO-Offload
    opt = ds_ops.CPUAdam(model.parameters(), state_dtype=torch.bfloat16)  # bf16 m, v: 20 B/param/step
    found_inf = ds_ops.adam_step(flat_params, flat_grads, exp_avg, exp_avg_sq, step, lr, grad_scale=1024.0)

``ds_ops.get_accelerator()`` is DeepSpeed's accelerator object (CPU, or CUDA when a GPU is visible).
``ds_ops.onebit`` holds the 1-bit compression kernels of ``ds_comm.compressed_allreduce``;
``ds_ops.quantize_blockwise`` and its inverses (``ds_ops.quantize``) the int8/int4 block quantization of
ZeRO++'s quantized collectives (``ds_comm.quantized_all_gather``, ``ds_comm.quantized_reduce_scatter``).
``ds-report`` lists every op, whether this machine can build it and whether it is built.
"""

__version__ = "0.1.0"

from ._accelerator import (
    SUPPORTED_ACCELERATOR_LIST,
    Accelerator,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)
from .adagrad import CPUAdagrad
from .adam import CPUAdam, FusedAdam, adam_step, has_inf_or_nan
from .lamb import FusedLamb
from .lion import CPULion
from .op_builder import OpBuilder, OpBuildError
from .quantize import (
    dequantize_blockwise,
    dequantize_sum_blockwise,
    quantize_blockwise,
    requantize_sum_blockwise,
)
from .sparse_attention import SparseAttentionConfig

__all__ = ["SUPPORTED_ACCELERATOR_LIST", "Accelerator", "CPUAdagrad", "CPUAdam", "CPULion", "FusedAdam", "FusedLamb",
           "OpBuildError", "OpBuilder", "SparseAttentionConfig", "__version__", "adam_step", "dequantize_blockwise",
           "dequantize_sum_blockwise", "get_accelerator", "has_inf_or_nan", "is_current_accelerator_supported",
           "quantize_blockwise", "requantize_sum_blockwise", "set_accelerator"]
