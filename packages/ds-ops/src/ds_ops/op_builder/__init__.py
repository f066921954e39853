"""The op builder: C++17 + pybind11 ops compiled with ninja just in time, cached, shared by ranks.

    from ds_ops.op_builder import CPUAdamBuilder
    module = CPUAdamBuilder().load()      # builds on first use, then loads from the cache

This package never imports torch. ``DS_OPS_CACHE`` moves the cache, ``DS_BUILD_SIMD`` picks
native/avx512/avx2/scalar, and ``DS_BUILD_OPS=1`` at ``pip install`` builds every op ahead.
"""

from .builder import OpBuilder, csrc_root
from .ops import (
    BUILDERS,
    CPUAdagradBuilder,
    CPUAdamBuilder,
    CPULambBuilder,
    CPULionBuilder,
    FusedAdamBuilder,
    FusedLambBuilder,
    OneBitBuilder,
    QuantizeBuilder,
    SparseAttentionBuilder,
)
from .system import OpBuildError, cache_root

__all__ = [
    "BUILDERS",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPULambBuilder",
    "CPULionBuilder",
    "FusedAdamBuilder",
    "FusedLambBuilder",
    "OneBitBuilder",
    "OpBuildError",
    "OpBuilder",
    "QuantizeBuilder",
    "SparseAttentionBuilder",
    "cache_root",
    "csrc_root",
]
