"""`SparseAttentionConfig`: the ``sparse_attention`` section of a DeepSpeed config."""

from __future__ import annotations

from typing import Literal

from ds_config import Section
from pydantic import Field

from . import sparsity_config as sc

# The keys each mode reads (the reference lists all keys in one example; the others are accepted
# and ignored, as DeepSpeed does, so a config that switches modes keeps loading).
MODE_KEYS = {
    "dense": (),
    "fixed": ("num_local_blocks", "num_global_blocks", "attention", "horizontal_global_attention",
              "num_different_global_patterns"),
    "variable": ("num_random_blocks", "local_window_blocks", "global_block_indices", "global_block_end_indices",
                 "attention", "horizontal_global_attention"),
    "bigbird": ("num_random_blocks", "num_sliding_window_blocks", "num_global_blocks", "attention"),
    "bslongformer": ("num_sliding_window_blocks", "global_block_indices", "global_block_end_indices", "attention"),
}
_CLASSES = {"dense": sc.DenseSparsityConfig, "fixed": sc.FixedSparsityConfig, "variable": sc.VariableSparsityConfig,
            "bigbird": sc.BigBirdSparsityConfig, "bslongformer": sc.BSLongformerSparsityConfig}


class SparseAttentionConfig(Section):
    """The ``sparse_attention`` section of ds_config.json: which layout, and its parameters."""

    section = "sparse_attention"

    mode: Literal["dense", "fixed", "variable", "bigbird", "bslongformer"] = Field(
        "fixed", description="The sparsity structure.")
    block: int = Field(16, gt=0, description="Block size: the layout is made of block x block tiles.")
    different_layout_per_head: bool = Field(False, description="Give each head its own layout where the mode can.")
    num_local_blocks: int = Field(4, gt=0, description="fixed: blocks per local window.")
    num_global_blocks: int = Field(1, gt=0, description="fixed, bigbird: global blocks per window / at the start.")
    attention: Literal["unidirectional", "bidirectional"] = Field("bidirectional", description="Causal or not.")
    horizontal_global_attention: bool = Field(False, description="fixed, variable: global blocks also attend to all.")
    num_different_global_patterns: int = Field(1, gt=0, description="fixed: distinct global patterns over heads.")
    num_random_blocks: int | None = Field(None, ge=0, description="variable (default 0), bigbird (default 1): "
                                                                  "random blocks per row.")
    local_window_blocks: list[int] = Field(default_factory=lambda: [4], description="variable: window sizes; "
                                                                                    "the last repeats.")
    global_block_indices: list[int] = Field(default_factory=lambda: [0], description="variable, bslongformer: "
                                                                                     "global blocks (or range starts).")
    global_block_end_indices: list[int] | None = Field(None, description="variable, bslongformer: range ends, exclusive.")
    num_sliding_window_blocks: int = Field(3, gt=0, description="bigbird, bslongformer: sliding window width.")

    def sparsity_config(self, num_heads: int) -> sc.SparsityConfig:
        """The layout builder of this mode for a model with ``num_heads`` heads (its checks raise
        ValueError naming the argument)."""
        kwargs = {key: getattr(self, key) for key in MODE_KEYS[self.mode]}
        if "num_random_blocks" in kwargs and kwargs["num_random_blocks"] is None:
            kwargs["num_random_blocks"] = 1 if self.mode == "bigbird" else 0
        return _CLASSES[self.mode](num_heads, block=self.block, different_layout_per_head=self.different_layout_per_head,
                                   **kwargs)
