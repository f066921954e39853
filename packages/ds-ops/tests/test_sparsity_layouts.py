"""Sparse-attention layouts, cell by cell against layouts drawn by hand from the definitions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseAttentionConfig,
    VariableSparsityConfig,
)


def grid(*rows: str) -> torch.Tensor:
    return torch.tensor([[int(c) for c in row.replace(" ", "")] for row in rows])


def test_dense_is_all_ones():
    assert torch.equal(DenseSparsityConfig(2, block=4).make_layout(12), torch.ones(2, 3, 3, dtype=torch.int64))


def test_fixed_bidirectional():
    layout = FixedSparsityConfig(1, block=1, num_local_blocks=4, num_global_blocks=1).make_layout(8)
    assert torch.equal(layout[0], grid("1111 0001", "1111 0001", "1111 0001", "1111 0001",
                                       "0001 1111", "0001 1111", "0001 1111", "0001 1111"))


def test_fixed_unidirectional():
    layout = FixedSparsityConfig(1, block=1, num_local_blocks=4, attention="unidirectional").make_layout(8)
    assert torch.equal(layout[0], grid("1000 0000", "1100 0000", "1110 0000", "1111 0000",
                                       "0001 1000", "0001 1100", "0001 1110", "0001 1111"))


def test_fixed_horizontal_global_and_partial_window():
    layout = FixedSparsityConfig(1, block=2, num_local_blocks=4, horizontal_global_attention=True).make_layout(12)
    # 6 blocks: windows [0-3], [4-5]; representatives: block 3, and block 5 for the partial window
    assert torch.equal(layout[0], grid("1111 01", "1111 01", "1111 01", "1111 11", "0001 11", "1111 11"))


def test_fixed_different_global_patterns_per_head():
    layout = FixedSparsityConfig(4, block=1, different_layout_per_head=True, num_local_blocks=4,
                                 num_different_global_patterns=2).make_layout(8)
    head0_globals, head1_globals = {3, 7}, {2, 6}
    for h, globals_ in ((0, head0_globals), (1, head1_globals), (2, head0_globals), (3, head1_globals)):
        columns = {c for c in range(8) if layout[h, :, c].all()}
        assert columns == globals_, (h, columns)


def test_fixed_same_layout_for_every_head_by_default():
    layout = FixedSparsityConfig(3, block=1).make_layout(8)
    assert torch.equal(layout[0], layout[1]) and torch.equal(layout[0], layout[2])


def test_variable_windows_and_globals():
    layout = VariableSparsityConfig(1, block=1, local_window_blocks=[2, 3], global_block_indices=[0]).make_layout(6)
    assert torch.equal(layout[0], grid("110000", "110000", "101110", "101110", "101110", "100001"))
    ranged = VariableSparsityConfig(1, block=1, local_window_blocks=[1], global_block_indices=[1],
                                    global_block_end_indices=[3]).make_layout(4)
    assert torch.equal(ranged[0], grid("1110", "0110", "0110", "0111"))


def test_variable_random_blocks_per_row():
    torch.manual_seed(0)
    layout = VariableSparsityConfig(1, block=1, num_random_blocks=2, local_window_blocks=[1],
                                    global_block_indices=[]).make_layout(16)
    extra = layout[0] - torch.eye(16, dtype=torch.int64)
    assert (layout[0].diagonal() == 1).all()
    assert ((extra.sum(dim=1) >= 1) & (extra.sum(dim=1) <= 2)).all()  # 2 draws, one may hit the diagonal


def test_bigbird_window_globals_random():
    torch.manual_seed(1)
    layout = BigBirdSparsityConfig(1, block=1, num_random_blocks=1, num_sliding_window_blocks=3,
                                   num_global_blocks=1).make_layout(8)
    fixed = torch.zeros(8, 8, dtype=torch.int64)
    for i in range(8):
        fixed[i, max(0, i - 1):i + 2] = 1
    fixed[0, :], fixed[:, 0] = 1, 1
    assert ((layout[0] - fixed) >= 0).all()  # the deterministic part is all there
    assert ((layout[0] - fixed).sum(dim=1) <= 1).all()  # plus at most one random block per row
    causal = BigBirdSparsityConfig(1, block=1, attention="unidirectional").make_layout(8)
    assert torch.equal(causal[0], torch.tril(causal[0]))


def test_bslongformer():
    layout = BSLongformerSparsityConfig(1, block=1, num_sliding_window_blocks=3).make_layout(5)
    assert torch.equal(layout[0], grid("11111", "11100", "11110", "10111", "10011"))
    ranged = BSLongformerSparsityConfig(1, block=1, num_sliding_window_blocks=1, global_block_indices=[0],
                                        global_block_end_indices=[2], attention="unidirectional").make_layout(4)
    assert torch.equal(ranged[0], grid("1000", "1100", "1110", "1101"))


def token_mask(seq_len: int, block: int, window_blocks: int, unidirectional: bool) -> torch.Tensor:
    """Which key each query sees under a local sliding window, token by token from the definition:
    key j is visible to query i when their blocks are at most window_blocks // 2 apart (and, when
    unidirectional, j's block is not after i's)."""
    qb = torch.arange(seq_len)[:, None] // block
    kb = torch.arange(seq_len)[None, :] // block
    keep = (qb - kb).abs() <= window_blocks // 2
    return keep & (kb <= qb) if unidirectional else keep


@pytest.mark.parametrize("window", [1, 3, 4, 7])
@pytest.mark.parametrize("attention", ["unidirectional", "bidirectional"])
def test_local_sliding_window_against_a_token_mask(window, attention):
    config = LocalSlidingWindowSparsityConfig(3, block=4, num_sliding_window_blocks=window, attention=attention)
    layout = config.make_layout(40)
    assert layout.shape == (3, 10, 10) and layout.dtype == torch.int64
    tokens = layout.bool().repeat_interleave(4, 1).repeat_interleave(4, 2)
    expected = token_mask(40, 4, window, attention == "unidirectional")
    for h in range(3):
        assert torch.equal(tokens[h], expected), h


def test_local_sliding_window_defaults_are_deepspeeds():
    config = LocalSlidingWindowSparsityConfig(2)
    assert (config.block, config.num_sliding_window_blocks, config.attention) == (16, 3, "unidirectional")
    assert config.different_layout_per_head is False
    assert torch.equal(config.make_layout(64)[0], grid("1000", "1100", "0110", "0011"))


@pytest.mark.parametrize("make, message", [
    (lambda: LocalSlidingWindowSparsityConfig(1, block=16, num_sliding_window_blocks=5).make_layout(64),
     r"num_sliding_window_blocks \(5\) exceeds the number of blocks in a row \(4\)"),
    (lambda: LocalSlidingWindowSparsityConfig(1, num_sliding_window_blocks=0), "num_sliding_window_blocks must be a "
                                                                               "positive integer, got 0"),
    (lambda: LocalSlidingWindowSparsityConfig(1, attention="causal"), "attention must be one of"),
    (lambda: FixedSparsityConfig(1, block=16).make_layout(40), "sequence length 40 must be divisible by block size 16"),
    (lambda: FixedSparsityConfig(1, num_local_blocks=4, num_global_blocks=3), r"num_local_blocks \(4\) must be divisible"),
    (lambda: FixedSparsityConfig(1, attention="unidirectional", horizontal_global_attention=True),
     "horizontal_global_attention needs attention='bidirectional'"),
    (lambda: FixedSparsityConfig(1, num_different_global_patterns=2), "needs different_layout_per_head=True"),
    (lambda: FixedSparsityConfig(2, different_layout_per_head=True, num_different_global_patterns=5),
     r"cannot exceed num_local_blocks // num_global_blocks \(4\)"),
    (lambda: FixedSparsityConfig(1, attention="causal"), "attention must be one of"),
    (lambda: BigBirdSparsityConfig(1, block=1, num_global_blocks=10).make_layout(4),
     r"num_global_blocks \(10\) exceeds the number of blocks in a row \(4\)"),
    (lambda: BigBirdSparsityConfig(1, block=1, num_random_blocks=5).make_layout(4),
     r"num_random_blocks \(5\) exceeds"),
    (lambda: VariableSparsityConfig(1, global_block_indices=[0, 4], global_block_end_indices=[2]),
     "global_block_end_indices must have as many entries"),
    (lambda: BSLongformerSparsityConfig(1, global_block_indices=[3], global_block_end_indices=[3]),
     "must be below its global_block_end_indices entry"),
    (lambda: DenseSparsityConfig(0), "num_heads must be a positive integer, got 0"),
])
def test_invalid_combinations_name_the_argument(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_config_section_builds_each_mode():
    shared = Path(__file__).resolve().parents[3].parent / "shared" / "configs" / "sparse_attention.json"
    section = json.loads(shared.read_text())["sparse_attention"] if shared.exists() else {
        "mode": "fixed", "different_layout_per_head": True, "num_different_global_patterns": 4}
    built = SparseAttentionConfig.model_validate(section).sparsity_config(num_heads=8)
    assert isinstance(built, FixedSparsityConfig) and built.num_different_global_patterns == 4
    # the reference's example lists every key in one section: it loads, and fixed ignores the others
    example = {"mode": "fixed", "block": 16, "different_layout_per_head": True, "num_local_blocks": 4,
               "num_global_blocks": 1, "attention": "bidirectional", "horizontal_global_attention": False,
               "num_different_global_patterns": 4, "num_random_blocks": 0, "local_window_blocks": [4],
               "global_block_indices": [0], "global_block_end_indices": None, "num_sliding_window_blocks": 3}
    assert SparseAttentionConfig.model_validate(example).sparsity_config(8).make_layout(256).shape == (8, 16, 16)
    for mode, cls in (("dense", DenseSparsityConfig), ("variable", VariableSparsityConfig),
                      ("bigbird", BigBirdSparsityConfig), ("bslongformer", BSLongformerSparsityConfig)):
        assert type(SparseAttentionConfig(mode=mode).sparsity_config(2)) is cls
    assert SparseAttentionConfig(mode="bigbird").sparsity_config(2).num_random_blocks == 1
    assert SparseAttentionConfig(mode="variable").sparsity_config(2).num_random_blocks == 0
    with pytest.raises(ValueError, match="unknown key 'num_local_block'; did you mean 'num_local_blocks'"):
        SparseAttentionConfig.model_validate({"num_local_block": 4})
    with pytest.raises(ValueError, match="mode"):
        SparseAttentionConfig.model_validate({"mode": "sliding"})
    # one strictness policy (ds-config): true is no block size, 16.0 is
    with pytest.raises(ValueError, match=r"sparse_attention\.block: must be an integer, got True"):
        SparseAttentionConfig(block=True)
    assert SparseAttentionConfig.model_validate({"block": 16.0}).block == 16
    assert SparseAttentionConfig.from_ds_config({"sparse_attention": {"mode": "bigbird"}}).mode == "bigbird"
