"""Block-sparse attention of ds-ops (DeepSpeed's ``deepspeed.ops.sparse_attention``).

    from ds_ops.sparse_attention import SparseSelfAttention, BigBirdSparsityConfig
    attention = SparseSelfAttention(BigBirdSparsityConfig(num_heads=8), max_seq_length=4096)
    out = attention(q, k, v)          # [batch, heads, seq, head_dim], only the layout's blocks

Layouts: `DenseSparsityConfig`, `FixedSparsityConfig`, `VariableSparsityConfig`,
`BigBirdSparsityConfig`, `BSLongformerSparsityConfig`, `LocalSlidingWindowSparsityConfig`;
`SparseAttentionConfig` is the ``sparse_attention`` config section and makes the right one (of
the first five: DeepSpeed's section has no mode for the local sliding window either). The kernels (SDD,
softmax, DSD, forward and backward) are C++ built by the op builder (op ``sparse_attn``).
`MatMul` (modes sdd, dsd, dds) and `Softmax` are DeepSpeed's standalone block-sparse ops, in PyTorch.
"""

from .attention import (
    BertSparseSelfAttention,
    BlockLayout,
    SparseAttentionUtils,
    SparseSelfAttention,
    pad_to_block_size,
    unpad,
)
from .blocksparse import MatMul, Softmax
from .config import SparseAttentionConfig
from .sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

__all__ = ["BSLongformerSparsityConfig", "BertSparseSelfAttention", "BigBirdSparsityConfig", "BlockLayout",
           "DenseSparsityConfig", "FixedSparsityConfig", "LocalSlidingWindowSparsityConfig", "MatMul", "Softmax",
           "SparseAttentionConfig", "SparseAttentionUtils", "SparseSelfAttention", "SparsityConfig",
           "VariableSparsityConfig", "pad_to_block_size", "unpad"]
