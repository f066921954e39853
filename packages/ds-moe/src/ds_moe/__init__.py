"""ds-moe: Mixture of Experts, DeepSpeed-compatible (``deepspeed.moe``).

`MoE` (DeepSpeed's layer: top-1/top-2/top-k gating, capacity and token dropping, expert parallelism over
all-to-all, PR-MoE), its parts `MOELayer`, `Experts`, `TopKGate`, the gating functions, the sparse dispatch
(`route_slots`, `sparse_encode`, `sparse_decode`: DeepSpeed's ``_route_slots``/``_sparse_encode``/``_sparse_decode``)
and the all-to-all it sends tokens through (`AllToAll`: DeepSpeed's ``_AllToAll``), the parameter
utilities of ``deepspeed.moe.utils`` and the expert process groups of ``deepspeed.utils.groups``
(`ds_moe.groups`).
"""

__version__ = "0.1.0"

from . import groups
from ._dispatch import AllToAll, route_slots, sparse_decode, sparse_encode
from ._experts import Experts
from ._gating import (
    Routing,
    TopKGate,
    gumbel_rsample,
    multiplicative_jitter,
    top1gating,
    top2gating,
    topkgating,
)
from ._layer import MoE, MOELayer
from ._utils import (
    configure_moe_param_groups,
    expert_checkpoint_names,
    has_moe_layers,
    is_moe_param,
    is_moe_param_group,
    split_params_grads_into_shared_and_expert_params,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)

__all__ = [
    "AllToAll", "Experts", "MOELayer", "MoE", "Routing", "TopKGate", "__version__", "configure_moe_param_groups",
    "expert_checkpoint_names", "groups", "gumbel_rsample", "has_moe_layers", "is_moe_param", "is_moe_param_group",
    "multiplicative_jitter", "route_slots", "sparse_decode", "sparse_encode",
    "split_params_grads_into_shared_and_expert_params", "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params", "top1gating", "top2gating", "topkgating",
]
