"""DeepSpeed's ``deepspeed.moe.sharded_moe``: ds-moe's gate (`TopKGate`, the gating functions, the noise
functions) and `MOELayer`."""

from ds_moe import (
    MOELayer,
    TopKGate,
    gumbel_rsample,
    multiplicative_jitter,
    top1gating,
    top2gating,
    topkgating,
)

__all__ = ["MOELayer", "TopKGate", "gumbel_rsample", "multiplicative_jitter", "top1gating", "top2gating", "topkgating"]
