"""Block-sparse attention layouts (DeepSpeed's sparsity configs, same arguments and defaults).

A layout is an int64 tensor ``[num_heads, seq_len // block, seq_len // block]``: 1 where a block of
queries (row) attends to a block of keys (column). With ``different_layout_per_head=False`` every
head copies head 0's layout. Random parts draw from ``torch``'s generator (seed it for
reproducible layouts).
"""

from __future__ import annotations

import torch

ATTENTION_TYPES = ("unidirectional", "bidirectional")


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class SparsityConfig:
    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False):
        self.num_heads = _positive("num_heads", num_heads)
        self.block = _positive("block", block)
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        if seq_len % self.block != 0:
            raise ValueError(f"sequence length {seq_len} must be divisible by block size {self.block} "
                             "(pad it: ds_ops.sparse_attention.pad_to_block_size)")
        n = seq_len // self.block
        return torch.zeros((self.num_heads, n, n), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        if not self.different_layout_per_head:
            layout[1:, :, :] = layout[0, :, :]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define make_layout")


def _check_attention(attention: str) -> str:
    if attention not in ATTENTION_TYPES:
        raise ValueError(f"attention must be one of {ATTENTION_TYPES}, got {attention!r}")
    return attention


def _fill_window(layout, h, start: int, end: int, unidirectional: bool) -> None:
    for row in range(start, end):
        layout[h, row, start:(row + 1 if unidirectional else end)] = 1


def _random_blocks(layout, h, count: int, unidirectional: bool) -> None:
    n = layout.shape[1]
    if count > n:
        raise ValueError(f"num_random_blocks ({count}) exceeds the number of blocks in a row ({n})")
    for row in range(n):
        choices = row + 1 if unidirectional else n
        picked = torch.randperm(choices)[: min(count, choices)]
        layout[h, row, picked] = 1


def _global_ranges(indices, end_indices, name="global_block_indices"):
    if end_indices is None:
        return [(i, i + 1) for i in indices]
    if len(end_indices) != len(indices):
        raise ValueError(f"global_block_end_indices must have as many entries as {name} "
                         f"({len(indices)}), got {len(end_indices)}")
    for start, end in zip(indices, end_indices, strict=True):
        if start >= end:
            raise ValueError(f"each global_block_indices entry must be below its global_block_end_indices entry, "
                             f"got {start} >= {end}")
    return list(zip(indices, end_indices, strict=True))


class DenseSparsityConfig(SparsityConfig):
    """Every block attends to every block: dense attention through the sparse machinery."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        layout[:] = 1
        return layout


class FixedSparsityConfig(SparsityConfig):
    """Local windows of ``num_local_blocks`` plus, per window, ``num_global_blocks`` global
    representatives (Child et al., "Generating Long Sequences with Sparse Transformers")."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_local_blocks: int = 4, num_global_blocks: int = 1, attention: str = "bidirectional",
                 horizontal_global_attention: bool = False, num_different_global_patterns: int = 1):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_local_blocks = _positive("num_local_blocks", num_local_blocks)
        self.num_global_blocks = _positive("num_global_blocks", num_global_blocks)
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(f"num_local_blocks ({num_local_blocks}) must be divisible by num_global_blocks "
                             f"({num_global_blocks})")
        self.attention = _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("horizontal_global_attention needs attention='bidirectional' "
                             "(a unidirectional block cannot attend to later blocks)")
        self.horizontal_global_attention = horizontal_global_attention
        _positive("num_different_global_patterns", num_different_global_patterns)
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError(f"num_different_global_patterns={num_different_global_patterns} needs "
                             "different_layout_per_head=True")
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ValueError(f"num_different_global_patterns ({num_different_global_patterns}) cannot exceed "
                             f"num_local_blocks // num_global_blocks ({num_local_blocks // num_global_blocks})")
        self.num_different_global_patterns = num_different_global_patterns

    def _set_global(self, layout, h, start: int, end: int) -> None:
        first_row = 0 if self.attention == "bidirectional" else start
        layout[h, first_row:, start:end] = 1
        if self.horizontal_global_attention:
            layout[h, start:end, :] = 1

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        n = layout.shape[1]
        local, g = self.num_local_blocks, self.num_global_blocks
        for h in range(self.num_layout_heads):
            for start in range(0, n, local):
                _fill_window(layout, h, start, min(start + local, n), self.attention == "unidirectional")
            # the representatives: the last g blocks of each full window (shifted per pattern)
            first = local - (1 + h % self.num_different_global_patterns) * g
            full_end = n - n % local
            for start in range(first, full_end, local):
                self._set_global(layout, h, start, start + g)
            if full_end < n:  # the last, partial window
                start = min(full_end + first, n - g)
                self._set_global(layout, h, start, start + g)
        return self.check_and_propagate_first_head_layout(layout)


class VariableSparsityConfig(SparsityConfig):
    """Local windows of varying size (``local_window_blocks``; the last size repeats), global
    blocks at given indices (or index ranges), and ``num_random_blocks`` random blocks per row."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 0, local_window_blocks=(4,), global_block_indices=(0,),
                 global_block_end_indices=None, attention: str = "bidirectional",
                 horizontal_global_attention: bool = False):
        super().__init__(num_heads, block, different_layout_per_head)
        if num_random_blocks < 0:
            raise ValueError(f"num_random_blocks must be >= 0, got {num_random_blocks}")
        self.num_random_blocks = num_random_blocks
        if not local_window_blocks:
            raise ValueError("local_window_blocks must name at least one window size")
        self.local_window_blocks = [_positive("local_window_blocks entry", w) for w in local_window_blocks]
        self.global_ranges = _global_ranges(list(global_block_indices),
                                            None if global_block_end_indices is None else list(global_block_end_indices))
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = global_block_end_indices
        self.attention = _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")
        self.horizontal_global_attention = horizontal_global_attention

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        n = layout.shape[1]
        unidirectional = self.attention == "unidirectional"
        for h in range(self.num_layout_heads):
            if self.num_random_blocks:
                _random_blocks(layout, h, self.num_random_blocks, unidirectional)
            start = 0
            for size in self.local_window_blocks:
                _fill_window(layout, h, start, min(start + size, n), unidirectional)
                start += size
            last = self.local_window_blocks[-1]
            for s in range(start, n, last):
                _fill_window(layout, h, s, min(s + last, n), unidirectional)
            for s, e in self.global_ranges:
                if s < n:
                    e = min(e, n)
                    if self.horizontal_global_attention:
                        layout[h, s:e, :] = 1
                    layout[h, 0 if not unidirectional else s:, s:e] = 1
        return self.check_and_propagate_first_head_layout(layout)


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (Zaheer et al. 2020): random blocks, a sliding window, and global blocks at the start."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 1, num_sliding_window_blocks: int = 3, num_global_blocks: int = 1,
                 attention: str = "bidirectional"):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = _positive("num_random_blocks", num_random_blocks)
        self.num_sliding_window_blocks = _positive("num_sliding_window_blocks", num_sliding_window_blocks)
        self.num_global_blocks = _positive("num_global_blocks", num_global_blocks)
        self.attention = _check_attention(attention)

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        n = layout.shape[1]
        for name, value in (("num_sliding_window_blocks", self.num_sliding_window_blocks),
                            ("num_global_blocks", self.num_global_blocks)):
            if value > n:
                raise ValueError(f"{name} ({value}) exceeds the number of blocks in a row ({n})")
        unidirectional = self.attention == "unidirectional"
        w = self.num_sliding_window_blocks // 2
        for h in range(self.num_layout_heads):
            _random_blocks(layout, h, self.num_random_blocks, unidirectional)
            for row in range(n):
                layout[h, row, max(0, row - w):min(row + w + 1, n)] = 1
            layout[h, : self.num_global_blocks, :] = 1
            layout[h, :, : self.num_global_blocks] = 1
            if unidirectional:
                layout[h] = torch.tril(layout[h])
        return self.check_and_propagate_first_head_layout(layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (Beltagy et al. 2020): a sliding window plus global blocks that
    attend to, and are attended by, every block."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_sliding_window_blocks: int = 3, global_block_indices=(0,), global_block_end_indices=None,
                 attention: str = "bidirectional"):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_sliding_window_blocks = _positive("num_sliding_window_blocks", num_sliding_window_blocks)
        self.global_ranges = _global_ranges(list(global_block_indices),
                                            None if global_block_end_indices is None else list(global_block_end_indices))
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = global_block_end_indices
        self.attention = _check_attention(attention)

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        n = layout.shape[1]
        if self.num_sliding_window_blocks > n:
            raise ValueError(f"num_sliding_window_blocks ({self.num_sliding_window_blocks}) exceeds the number of "
                             f"blocks in a row ({n})")
        w = self.num_sliding_window_blocks // 2
        for h in range(self.num_layout_heads):
            for row in range(n):
                layout[h, row, max(0, row - w):min(row + w + 1, n)] = 1
            for s, e in self.global_ranges:
                if s < n:
                    e = min(e, n)
                    layout[h, s:e, :] = 1
                    layout[h, :, s:e] = 1
            if self.attention == "unidirectional":
                layout[h] = torch.tril(layout[h])
        return self.check_and_propagate_first_head_layout(layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A purely local sliding window (DeepSpeed's LocalSlidingWindowSparsityConfig): each block row
    attends to the ``num_sliding_window_blocks // 2`` blocks on either side of its own block;
    ``attention="unidirectional"`` (the default, as DeepSpeed's) keeps only the blocks up to its own."""

    def __init__(self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3,
                 attention: str = "unidirectional"):
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = _positive("num_sliding_window_blocks", num_sliding_window_blocks)
        self.attention = _check_attention(attention)

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        n = layout.shape[1]
        if self.num_sliding_window_blocks > n:
            raise ValueError(f"num_sliding_window_blocks ({self.num_sliding_window_blocks}) exceeds the number of "
                             f"blocks in a row ({n})")
        w = self.num_sliding_window_blocks // 2
        for row in range(n):
            end = row + 1 if self.attention == "unidirectional" else min(row + w + 1, n)
            layout[0, row, max(0, row - w):end] = 1
        return self.check_and_propagate_first_head_layout(layout)
