# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.moe.sharded_moe``: ds-moe's gate (`TopKGate`, the gating functions, the noise
functions), `MOELayer`, and the module-level names DeepSpeed's own tests reach:

* ``_route_slots``, ``_sparse_encode``, ``_sparse_decode``: ds-moe's `route_slots`, `sparse_encode`,
  `sparse_decode` (the sparse dispatch `MOELayer` runs), with DeepSpeed's signatures and results.
* ``_AllToAll``: ds-moe's `AllToAll`, the same class object `MOELayer` sends tokens through, so patching
  ``_AllToAll.apply`` here changes (or counts) the layer's all-to-alls.
* ``dist``: the communication module the gating functions call (``ds_comm``, whose public names are
  ``deepspeed.comm``'s), so patching ``dist.all_reduce`` here changes (or counts) the dropless capacity's
  all-reduce over the expert-parallel group.
"""

import ds_comm as dist
from ds_moe import AllToAll as _AllToAll
from ds_moe import (
    MOELayer,
    TopKGate,
    gumbel_rsample,
    multiplicative_jitter,
    top1gating,
    top2gating,
    topkgating,
)
from ds_moe import route_slots as _route_slots
from ds_moe import sparse_decode as _sparse_decode
from ds_moe import sparse_encode as _sparse_encode

__all__ = ["MOELayer", "TopKGate", "_AllToAll", "_route_slots", "_sparse_decode", "_sparse_encode",
           "dist", "gumbel_rsample", "multiplicative_jitter", "top1gating", "top2gating",
           "topkgating"]
