"""DeepSpeed's ``deepspeed.utils``: ``logger``, ``log_dist``, ``RepeatingLoader``, ``set_random_seed``, the
``groups`` module (the process groups of each kind of parallelism), and the state-access functions of
``tensor_fragment`` (``safe_get_full_fp32_param``, ``safe_set_full_optimizer_state``, ...: ds-zero's)."""

from .._data import RepeatingLoader
from .._utils import log_dist, logger, set_random_seed
from . import groups, tensor_fragment  # noqa: F401  (deepspeed.utils.groups, deepspeed.utils.tensor_fragment)
from .tensor_fragment import (
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

__all__ = ["RepeatingLoader", "log_dist", "logger", "safe_get_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state", "safe_get_local_fp32_param", "safe_get_local_grad",
           "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
           "safe_set_full_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
           "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized", "set_random_seed"]
