"""Block-sparse attention of ds-ops (the ``sparse_attention`` config section).

Layouts so far: `DenseSparsityConfig`, `FixedSparsityConfig`, `VariableSparsityConfig`,
`BigBirdSparsityConfig`, `BSLongformerSparsityConfig` and `SparseAttentionConfig`. The kernels
(SDD, softmax, DSD) and `SparseSelfAttention` are still to come.
"""

from .config import SparseAttentionConfig
from .sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

__all__ = ["BSLongformerSparsityConfig", "BigBirdSparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig",
           "SparseAttentionConfig", "SparsityConfig", "VariableSparsityConfig"]
